"""Tokenization off the serving process: a pool of tokenizer worker processes (tokenizer_worker.py).

    Serving --await pool.encode / render_chat / decode / tokenize_body--> an idle worker (FIFO)
        --frame over its stdin (JSON header + raw payload)--> worker: template, encode, decode
        <--frame over its stdout-- Encoded(count, token_ids | None, prompt)

Encoding a long text holds the GIL for its whole length; in the serving process that would stall the
engine thread and the event loop (every stream, /health). Here the event loop only moves bytes.
A call holds its worker until the reply is read, even when the caller is cancelled (client gone), so
replies never cross. A worker that dies, breaks the protocol (a malformed reply) or takes longer than
`timeout_s` for one call (it is killed) fails that call (500) and is replaced; a replacement that fails
to start is retried with a growing backoff. While no worker is alive and none is starting, calls fail
at once ("unavailable": 503) instead of waiting, and `available` (the server's /health) is false.

Workers run `python -P` from the filesystem root: neither the server's working directory nor the
script's is on their import path (a json.py there must not be imported), only this package's root.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jaxserve.framing import FRAME_HEAD, MAX_FRAME_BYTES, bytes_to_ids, encode_frame, ids_to_bytes

logger = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # the workers import this jaxserve
_CLOSE_TIMEOUT_S = 5.0
_RESPAWN_BACKOFF_S = (0.25, 30.0)  # first wait after a failed re-spawn; it doubles up to the second


class TokenizeError(Exception):
    """A request's text could not be rendered or tokenized: kind "template" | "value" (400), "unavailable"
    (503: no worker is running), else ("internal", "timeout") 500."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _ProtocolError(RuntimeError):
    """The worker's reply is not a well-formed frame."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    count: int  # tokens
    token_ids: list[int] | None  # None when count >= max_model_len (too long to serve)
    prompt: str | None = None  # the rendered chat


class _Worker:
    """One worker process and the event loop's ends of its pipes."""

    def __init__(self, process: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 read_transport: asyncio.ReadTransport):
        self.process = process
        self.reader = reader
        self.writer = writer
        self.read_transport = read_transport

    @classmethod
    async def spawn(cls, command: list[str], env: dict[str, str]) -> _Worker:
        # NOTE: subprocess.Popen (vfork + exec), not the event loop's subprocess support: uvloop forks,
        # which runs JAX's at-fork warning in a multithreaded process.
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/")
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        read_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), process.stdout)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, process.stdin)
        return cls(process, reader, asyncio.StreamWriter(transport, protocol, None, loop), read_transport)

    async def call(self, header: dict[str, Any], payload: bytes, timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """One request and its reply; past `timeout_s` the worker is killed (TimeoutError)."""
        try:
            async with asyncio.timeout(timeout_s):
                self.writer.write(encode_frame(header, payload))
                await self.writer.drain()
                return await self.read()
        except TimeoutError:
            self.kill()
            raise

    async def read(self) -> tuple[dict[str, Any], bytes]:
        header_len, payload_len = FRAME_HEAD.unpack(await self.reader.readexactly(FRAME_HEAD.size))
        if header_len + payload_len > MAX_FRAME_BYTES:
            raise _ProtocolError(f"tokenizer worker sent a frame of {header_len + payload_len} bytes")
        raw = await self.reader.readexactly(header_len)
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise _ProtocolError(f"tokenizer worker sent a malformed reply header ({err})") from None
        if not isinstance(header, dict):
            raise _ProtocolError(f"tokenizer worker sent a reply header that is no JSON object: {raw[:80]!r}")
        return header, await self.reader.readexactly(payload_len)

    async def close(self, timeout: float) -> None:
        """End its input (the worker exits), wait for it, kill it if it does not."""
        self.writer.close()
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.process.wait), timeout)
        except TimeoutError:
            self.kill()
        # NOTE: through its transport, which unregisters the descriptor before closing it: closing the
        # pipe under a live transport lets the descriptor's number, reused by a client's socket, be read
        # by this transport.
        self.read_transport.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()


class TokenizerPool:
    def __init__(self, tokenizer_dir: str, max_model_len: int, size: int, timeout_s: float = 60.0):
        self.tokenizer_dir = os.path.abspath(tokenizer_dir)  # the workers run from "/"
        self.max_model_len = max_model_len
        self.size = size
        self.timeout_s = timeout_s  # one call's limit (server.tokenizer_timeout_s)
        self.max_chars_per_token: int | None = None
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()  # started (hello received) and not known dead; idle or busy
        self._spawning: set[_Worker] = set()  # processes not started yet (close() kills them too)
        self._starting = 0  # replacements being started, or about to be
        self._none_alive = asyncio.Event()  # set: no worker in _workers and none starting
        self._replacing: set[asyncio.Task] = set()
        self._closed = False

    @property
    def max_prompt_chars(self) -> int | None:
        """Longer texts cannot fit max_model_len tokens (char_bound.py); None: no bound is known."""
        bound = self.max_chars_per_token
        return None if bound is None else self.max_model_len * bound

    @property
    def available(self) -> bool:
        """Whether a worker is running (the server's /health answers 503 while none is)."""
        return bool(self._workers)

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the tokenizer (raises if one cannot)."""
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)), return_exceptions=True)
        failed = [w for w in workers if isinstance(w, BaseException)]
        for worker in workers:
            if not isinstance(worker, BaseException):
                self._idle.put_nowait(worker)
        if failed:
            await self.close()
            raise RuntimeError(f"tokenizer workers failed to start: {failed[0]}") from failed[0]

    async def _spawn(self) -> _Worker:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT,
                                                                          os.environ.get("PYTHONPATH")]))}
        # -P: the working directory is not put on the import path (Python >= 3.11)
        worker = await _Worker.spawn([sys.executable, "-P", "-m", "jaxserve.server.tokenizer_worker", "--tokenizer",
                                      self.tokenizer_dir, "--max-model-len", str(self.max_model_len)], env)
        self._spawning.add(worker)
        try:
            hello, _ = await worker.read()
        except (asyncio.IncompleteReadError, _ProtocolError) as err:
            await self._discard(worker)
            raise RuntimeError("tokenizer worker exited while starting (its error is in the log above)") from err
        finally:
            self._spawning.discard(worker)
        if not hello.get("ok"):
            await self._discard(worker)
            raise RuntimeError(hello.get("error", "tokenizer worker failed"))
        self.max_chars_per_token = hello["max_chars_per_token"]
        self._workers.add(worker)
        self._update_alive()
        return worker

    async def close(self) -> None:
        self._closed = True
        for task in self._replacing:
            task.cancel()
        for worker in self._spawning:
            worker.kill()
        await asyncio.gather(*(worker.close(_CLOSE_TIMEOUT_S) for worker in self._workers))
        self._workers.clear()

    def _update_alive(self) -> None:
        if self._workers or self._starting:
            self._none_alive.clear()
        else:
            self._none_alive.set()

    def _unavailable(self) -> TokenizeError:
        return TokenizeError("unavailable", "no tokenizer worker is running (they failed to restart; the server log "
                                            "says why); retry later")

    async def _acquire(self) -> _Worker:
        """The longest-idle worker; TokenizeError("unavailable") at once while none is alive and none is
        starting, and when that becomes so during the wait."""
        try:
            return self._idle.get_nowait()
        except asyncio.QueueEmpty:
            if self._none_alive.is_set():
                raise self._unavailable() from None
        getter = asyncio.ensure_future(self._idle.get())
        watcher = asyncio.ensure_future(self._none_alive.wait())
        try:
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled: a worker it got goes back
            if getter.done() and not getter.cancelled():
                self._idle.put_nowait(getter.result())
            getter.cancel()
            raise
        finally:
            watcher.cancel()
        if getter.done():
            return getter.result()
        getter.cancel()  # (an item it was woken for stays queued for the next getter)
        raise self._unavailable()

    async def call(self, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        if self._closed:
            raise RuntimeError("the tokenizer pool is closed")
        worker = await self._acquire()
        task = asyncio.ensure_future(worker.call(header, payload, self.timeout_s))
        task.add_done_callback(functools.partial(self._returned, worker))
        try:
            header, payload = await asyncio.shield(task)
        except TimeoutError:
            raise TokenizeError("timeout", f"tokenizing took longer than server.tokenizer_timeout_s="
                                           f"{self.timeout_s:g} s; the worker was stopped and is being replaced. "
                                           f"Shorten the input, or raise tokenizer_timeout_s") from None
        except (asyncio.IncompleteReadError, ConnectionError, RuntimeError) as err:
            raise TokenizeError("internal", f"the tokenizer worker failed ({err!r}); it is being replaced, "
                                            f"retry the request") from None
        if not header.get("ok"):
            raise TokenizeError(header.get("kind", "internal"), header.get("error", "tokenization failed"))
        return header, payload

    def _returned(self, worker: _Worker, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self._idle.put_nowait(worker)
            return
        error = "cancelled" if task.cancelled() else repr(task.exception())
        logger.error("tokenizer worker failed (%s); replacing it", error)
        worker.kill()
        self._workers.discard(worker)
        if not self._closed:
            self._starting += 1
            replacing = asyncio.ensure_future(self._replace(worker))
            self._replacing.add(replacing)
            replacing.add_done_callback(self._replacing.discard)
        self._update_alive()

    async def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)
        self._update_alive()
        await worker.close(_CLOSE_TIMEOUT_S)

    async def _replace(self, worker: _Worker) -> None:
        """Start a worker in `worker`'s place, retrying with a growing backoff until one starts. Counted
        in _starting while an attempt is under way (the caller counted the first)."""
        await worker.close(_CLOSE_TIMEOUT_S)
        backoff = _RESPAWN_BACKOFF_S[0]
        while True:
            try:
                try:
                    new = await self._spawn()
                finally:
                    self._starting -= 1
                    self._update_alive()
            except Exception:  # noqa: BLE001 - retried; meanwhile the pool serves with one worker fewer
                logger.exception("could not start a tokenizer worker; retrying in %.2g s", backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _RESPAWN_BACKOFF_S[1])
                self._starting += 1
                self._update_alive()
                continue
            if self._closed:  # closed while it started
                self._workers.discard(new)
                await new.close(_CLOSE_TIMEOUT_S)
            else:
                self._idle.put_nowait(new)
            return

    # ---- the calls Serving makes ----
    async def encode(self, text: str, add_special_tokens: bool) -> Encoded:
        header, payload = await self.call({"op": "encode", "add_special_tokens": add_special_tokens},
                                          text.encode("utf-8", "surrogatepass"))
        return Encoded(header["count"], bytes_to_ids(payload) if payload else None)

    async def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None,
                          template_kwargs: dict[str, Any], add_special_tokens: bool,
                          tools: list[dict[str, Any]] | None = None) -> Encoded:
        header, payload = await self.call(*self._chat_frame(messages, add_generation_prompt, continue_final_message,
                                                            chat_template, template_kwargs, add_special_tokens,
                                                            tools))
        return Encoded(header["count"], bytes_to_ids(payload) if payload else None, header.get("prompt"))

    async def tokenize_body(self, text: str | None, messages: list[dict[str, Any]] | None, *,
                            add_special_tokens: bool, return_token_strs: bool, **chat: Any) -> bytes:
        """/tokenize's JSON response body {count, max_model_len, tokens, token_strs}, built by the worker."""
        if messages is not None:
            header, payload = self._chat_frame(messages, add_special_tokens=add_special_tokens, **chat)
        else:
            header = {"op": "encode", "add_special_tokens": add_special_tokens}
            payload = text.encode("utf-8", "surrogatepass")
        _, body = await self.call({**header, "reply": "tokenize", "return_token_strs": return_token_strs}, payload)
        return body

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        _, payload = await self.call({"op": "decode", "skip_special_tokens": skip_special_tokens},
                                     ids_to_bytes(token_ids))
        return payload.decode("utf-8", "surrogatepass")

    @staticmethod
    def _chat_frame(messages, add_generation_prompt, continue_final_message, chat_template, template_kwargs,
                    add_special_tokens, tools=None) -> tuple[dict[str, Any], bytes]:
        """A chat's header and payload: the messages' text contents travel as raw UTF-8 in the payload
        (their byte lengths in "contents"), so the event loop never JSON-escapes a long message."""
        contents = [m["content"].encode("utf-8", "surrogatepass") if isinstance(m.get("content"), str) else None
                    for m in messages]
        stripped = [{k: v for k, v in m.items() if k != "content"} if c is not None else m
                    for m, c in zip(messages, contents)]
        header = {"op": "encode", "messages": stripped, "contents": [-1 if c is None else len(c) for c in contents],
                  "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                  "chat_template": chat_template, "tools": tools, "template_kwargs": template_kwargs,
                  "add_special_tokens": add_special_tokens}
        return header, b"".join(c for c in contents if c is not None)
