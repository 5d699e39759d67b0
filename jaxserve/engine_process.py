"""The engine in its own process (`server.engine_process: true`, the default of `jaxserve serve`).

    server process                                   engine process (python -m jaxserve.engine_process)
    --------------                                   --------------
    ProcessEngineClient, an engine client:           reader thread: frames from stdin -> the inbox
      prepare_request here (tokenizer, limits)         (info: answered at once from this thread)
      enqueue / abort_request -> writer thread       engine loop (main thread): inbox (add, abort, close)
        --frames on stdin-->                           -> engine.step() -> the outputs' deltas, refusals,
      reader thread <--a frame per step with news,     stats (jaxserve/engine_wire.py)
        stdout-- -> the output handler (the server's
           ProcessBridge: to the event loop), or queued for step()
      outputs_of(frames): the frames' outputs (OutputAssembler: cumulative RequestOutputs, as the engine's)

In one process the engine loop and the HTTP event loop (SSE sends, JSON, sockets) take turns at the
interpreter lock: a step's host work waits while the event loop runs Python. Here the engine loop has
its interpreter to itself; the server process only reads frames and serves HTTP.

Start: the server writes {"op": "start", "config", "log_level"}; the engine process builds the engine
(build_engine: Engine, DataParallelEngine, PDEngine for a PD role) and answers {"op": "hello", ...facts}
or {"op": "failed", "error", "kind"}, which the server raises (ValueError for a bad configuration).
Failure: an exception in the engine loop is sent as {"op": "fatal"} (the server then kills the engine
process); its end, for any reason (crash, kill), reaches the output handler (or makes step() raise), which
fails every open request and turns /health to 503.
Shutdown: close() sends {"op": "close"}; the engine process aborts what is left, closes its engine (a KV
disk tier is written) and exits. It also ends when its stdin closes, and is killed when the server process
dies (Linux: PR_SET_PDEATHSIG), as an engine thread would die with it. It ignores SIGINT and SIGTERM, which
a terminal or a service manager sends to the whole process group: the server drains its requests first,
then closes it. Its prints and logs go to the server's stderr.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from jaxserve.config import EngineConfig
from jaxserve.engine_client import EngineStats, PreparedRequest, PromptType
from jaxserve.engine_wire import (OutputAssembler, OutputDeltas, decode_prepared, decode_stats, encode_prepared,
                                  encode_stats)
from jaxserve.framing import claim_stdout, encode_frame, read_frame
from jaxserve.input_processor import InputProcessor
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # the engine process imports this jaxserve
CLOSE_TIMEOUT_S = 300.0  # closing writes a KV disk tier's blocks; then the engine process is killed
CALL_TIMEOUT_S = 10.0  # an info() call without an answer
# A step frame carries the engine's stats (and a PD instance's gauges) when a request finished or was refused,
# when the engine goes idle, and at least this often in between.
STATS_INTERVAL_S = 0.05
PD_IDLE_GAUGES_S = 1.0  # an idle PD instance looks this often whether its control threads moved its gauges
_F_SETPIPE_SZ, _PIPE_BYTES = 1031, 1 << 20


class EngineProcessError(RuntimeError):
    """The engine process failed or is gone."""


def build_engine(config: EngineConfig, progress: bool = True):
    """The engine `jaxserve serve` runs for `config`: Engine, or DataParallelEngine when parallel.data > 1,
    wrapped in a PDEngine when server.pd_role is set."""
    from jaxserve.data_parallel import DataParallelEngine
    from jaxserve.engine import Engine

    engine = Engine(config, progress=progress) if config.parallel.data == 1 else DataParallelEngine(config, progress)
    if config.server.pd_role is not None:
        from jaxserve.pd.engine import PDEngine

        engine = PDEngine(engine, config)
        logger.info("PD role %s; KV transfer endpoint %s", engine.role, engine.kv_transfer_address or "(none)")
    return engine


class ProcessEngineClient:
    """An engine client whose engine runs in a child process (see the module docstring). Build it on a thread
    that lives as long as it (the main thread): the child is killed when that thread ends."""

    def __init__(self, config: EngineConfig, log_level: str = "info"):
        self.config = config
        # NOTE: subprocess (vfork + exec), never a fork of this process: JAX or uvloop threads may run here.
        # `-P` and this package's root first on the path: the child imports this jaxserve, never one that
        # happens to be in the working directory (which it keeps: the config's relative paths are from there).
        path = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
        self.process = subprocess.Popen([sys.executable, "-P", "-m", "jaxserve.engine_process"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env={**os.environ, "PYTHONPATH": path})
        for pipe in (self.process.stdin, self.process.stdout):  # (Linux) room for many frames either way
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        # Frames to the engine process go through one writer thread: a sender (the event loop) never blocks
        # on a full pipe, and frames keep their order.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._write_error: str | None = None
        self._writer = threading.Thread(target=self._write, name="jaxserve-engine-writer", daemon=True)
        self._writer.start()
        self._send({"op": "start", "config": config.to_dict(), "log_level": log_level})
        hello = self._hello()
        self.max_model_len: int = hello["max_model_len"]
        self.vocab_size: int = hello["vocab_size"]
        self.sampling_defaults: dict[str, Any] = hello["sampling_defaults"]
        self.role: str | None = config.server.pd_role
        self.kv_transfer_address: str | None = hello["kv_transfer_address"]
        model = config.model
        tokenizer = None if model.skip_tokenizer_init else Tokenizer.from_dir(model.tokenizer or model.path)
        sched = config.scheduler
        self.input_processor = InputProcessor(
            tokenizer, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=tuple(hello["eos_token_ids"]), max_n=sched.max_n, max_logprobs=sched.max_logprobs,
            max_banned=hello["max_banned"], seed=model.seed)
        self._assembler = OutputAssembler()  # one thread: step()'s caller, or the output handler's (event loop)
        self._cond = threading.Condition()
        self._frames: deque[dict[str, Any]] = deque()  # step frames with outputs, not yet taken by step()
        self._handler = None  # takes each step frame instead of step() (set_output_handler)
        self._ended: str | None = None  # why the engine process is gone
        self._stats_frame: dict[str, Any] | None = None
        self._stats = EngineStats()
        self._pd_gauges: dict[str, Any] = hello["pd"] or {"free": 0, "open": 0, "counts": {}}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="jaxserve-engine-reader", daemon=True)
        self._reader.start()

    def _hello(self) -> dict[str, Any]:
        try:
            frame = read_frame(self.process.stdout)
        except (OSError, EOFError, ValueError):
            frame = None
        if frame is not None and frame[0]["op"] == "hello":
            return frame[0]
        self._outbox.put(None)
        code = self.process.wait()
        if frame is not None and frame[0]["op"] == "failed":
            error = frame[0]["error"]
            raise (ValueError if frame[0]["kind"] == "value" else EngineProcessError)(error)
        raise EngineProcessError(f"the engine process exited with code {code} before it started (its log above "
                                 f"says why)")

    # ---- the engine client surface ----
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.input_processor.tokenizer

    def prepare_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                        request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                        tenant: str | None = None, strict: bool = False) -> PreparedRequest:
        return self.input_processor.prepare(prompt, params, request_id=request_id, priority=priority,
                                            cache_salt=cache_salt, tenant=tenant, strict=strict)

    def accept_kv_transfer_params(self, prepared: PreparedRequest, params: Any, index: int) -> None:
        if self.role is None:
            raise ValueError("kv_transfer_params is only accepted by a prefill or decode instance (server.pd_role) "
                             "behind `jaxserve router`; leave it out")
        from jaxserve.pd import protocol as proto

        proto.bind_transfer(prepared, params, index, proto.derive_key(self.config.server.kv_transfer_token),
                            self.role)

    def enqueue(self, prepared: PreparedRequest) -> None:
        if prepared.request_id in self._assembler:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        header, payload = encode_prepared(prepared)
        self._send({"op": "add", **header}, payload)
        self._assembler.add(prepared)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, **kwargs: Any) -> str:
        prepared = self.prepare_request(prompt, params, **kwargs)
        self.enqueue(prepared)
        return prepared.request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [i for i in ([request_ids] if isinstance(request_ids, str) else request_ids) if i in self._assembler]
        if ids:
            self._send({"op": "abort", "ids": ids})

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """The outputs of the engine process's steps since the last call; waits for one. Raises
        EngineProcessError once the engine process is gone."""
        with self._cond:
            while not self._frames and self._ended is None:
                self._cond.wait()
            frames, self._frames = self._frames, deque()
            if not frames and self._ended is not None:
                raise EngineProcessError(self._ended)
        return self.outputs_of(frames, final_only)

    def outputs_of(self, frames, final_only: bool = False) -> list[RequestOutput]:
        """The outputs of step frames (in order; one caller at a time): the latest of each request. A request
        the engine refused (a ValueError there) finishes with "abort"; refusals(frame) names them."""
        latest: dict[str, RequestOutput] = {}  # outputs are cumulative: a request's last one holds its earlier ones
        for frame in frames:
            for request_id, error in frame["rejected"]:
                logger.warning("the engine refused request %s: %s", request_id, error)
            found = [self._assembler.abort(request_id) for request_id, _ in frame["rejected"]]
            found += [self._assembler.apply(delta) for delta in frame["outputs"]]
            latest.update((output.request_id, output) for output in found if output is not None)
        return [output for output in latest.values() if output.finished or not final_only]

    @staticmethod
    def refusals(frame: dict[str, Any]) -> list[tuple[str, ValueError]]:
        """(request id, the engine's ValueError) of each request the engine refused in this frame."""
        return [(request_id, ValueError(error)) for request_id, error in frame["rejected"]]

    def has_unfinished_requests(self) -> bool:
        return len(self._assembler) > 0 or bool(self._frames) or self._ended is not None

    def stats(self) -> EngineStats:
        with self._cond:
            frame, self._stats_frame = self._stats_frame, None
        if frame is not None:
            self._stats = decode_stats(frame)
        return self._stats

    def close(self) -> None:
        """Asks the engine process to close its engine and exit; waits for it (killed after CLOSE_TIMEOUT_S)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(EngineProcessError):
            self._send({"op": "close"})
        self._outbox.put(None)  # the writer closes the pipe after the frames before
        try:
            self.process.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.error("the engine process did not exit within %.0f s of close; killing it", CLOSE_TIMEOUT_S)
            self.process.kill()
            self.process.wait()
        self._reader.join(CALL_TIMEOUT_S)

    # ---- the server's ProcessBridge (server/bridge.py) and the PD instance's surface (pd/serve.py) ----
    def set_output_handler(self, handler) -> None:
        """From now, `handler(frame)` takes each step frame (on the reader thread; outputs_of turns it into
        outputs; one with "stats" has updated stats()), and `handler(EngineProcessError)` the engine process's
        end; None: back to step()."""
        with self._cond:  # (under the lock, as the reader hands frames over: they stay in order)
            self._handler = handler
            if handler is not None:
                pending, self._frames = self._frames, deque()
                for frame in pending:
                    self._hand(handler, frame)
                if self._ended is not None:
                    self._hand(handler, EngineProcessError(self._ended))

    async def info(self) -> dict[str, Any]:
        """A PD instance's GET /pd/info body, from the engine process."""
        import asyncio

        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._ended is not None:
                raise EngineProcessError(self._ended)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        try:
            self._send({"op": "info", "id": call_id})
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        finally:
            with self._cond:
                self._calls.pop(call_id, None)

    @property
    def num_free_blocks(self) -> int:
        return self._pd_gauges["free"]

    @property
    def num_open_transfers(self) -> int:
        return self._pd_gauges["open"]

    @property
    def counts(self) -> dict[str, int]:
        return self._pd_gauges["counts"]

    # ---- the pipes ----
    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Queues a frame for the writer thread; raises EngineProcessError once writing has failed."""
        if self._write_error is not None:
            raise EngineProcessError(self._write_error)
        self._outbox.put(encode_frame(header, payload))

    def _write(self) -> None:
        stdin = self.process.stdin
        try:
            while (data := self._outbox.get()) is not None:
                stdin.write(data)
                stdin.flush()
        except (OSError, ValueError) as err:  # the engine process is gone; the reader reports its end
            self._write_error = f"the engine process is gone ({err!r}); its log says why"
        with contextlib.suppress(OSError):
            stdin.close()

    def _read(self) -> None:
        reason = None
        try:
            while (frame := read_frame(self.process.stdout)) is not None:
                header = frame[0]
                op = header["op"]
                if op == "step":
                    with self._cond:
                        if "stats" in header:
                            self._stats_frame = header["stats"]
                        if "pd" in header:
                            self._pd_gauges = header["pd"]
                        if self._handler is not None:
                            self._hand(self._handler, header)
                        elif header["outputs"] or header["rejected"]:
                            self._frames.append(header)
                            self._cond.notify()
                elif op == "reply":
                    with self._cond:
                        future = self._calls.pop(header["id"], None)
                    if future is not None and not future.done():  # (not given up on: info() timed out)
                        if "error" in header:
                            future.set_exception(EngineProcessError(header["error"]))
                        else:
                            future.set_result(header["value"])
                elif op == "fatal":
                    reason = f"engine failed: {header['error']}"
                    self.process.kill()  # its requests fail now, not after its interpreter's shutdown
                    break
        except Exception as err:  # noqa: BLE001 - any broken frame ends the engine process's use
            reason = f"reading the engine process's output failed: {err!r}"
            self.process.kill()
        finally:
            code = self.process.wait()
            reason = reason or f"the engine process exited with code {code} (its log above says why)"
            if not self._closed:
                logger.error("%s", reason)
            with self._cond:
                self._ended = reason
                calls, self._calls = self._calls, {}
                if self._handler is not None:
                    self._hand(self._handler, EngineProcessError(reason))
                self._cond.notify()
            for future in calls.values():
                if not future.done():
                    future.set_exception(EngineProcessError(reason))

    def _hand(self, handler, item) -> None:
        """`handler(item)` (under self._cond); a handler that fails (the server's event loop closed) is dropped."""
        try:
            handler(item)
        except Exception:  # noqa: BLE001 - nobody takes outputs any more
            if self._handler is handler:
                self._handler = None


# ---- the engine process ----
class _EngineLoop:
    """The engine process's loop: commands from the server, steps, a frame after each step with something
    to report (outputs, refusals, stats)."""

    def __init__(self, engine, inp: BinaryIO, out: BinaryIO):
        self.engine = engine
        self.out = out
        self.write_lock = threading.Lock()
        self.cond = threading.Condition()
        self.inbox: list[tuple[dict[str, Any], bytes]] = []
        self.closing = False
        self.open: set[str] = set()  # requests enqueued, not finished
        self.deltas = OutputDeltas()
        self.stats_sent = 0.0  # when the last frame with stats was written
        self.gauges_sent: dict[str, Any] | None = None  # a PD instance's, in the last frame with them
        self.is_pd = hasattr(engine, "step_log")
        if hasattr(engine, "set_waker"):
            engine.set_waker(self.wake)
        threading.Thread(target=self._read, args=(inp,), name="jaxserve-engine-commands", daemon=True).start()

    def write(self, header: dict[str, Any]) -> None:
        data = encode_frame(header)
        with self.write_lock:
            self.out.write(data)
            self.out.flush()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def _read(self, inp: BinaryIO) -> None:
        try:
            while (frame := read_frame(inp)) is not None:
                header, payload = frame
                if header["op"] == "info":  # read-only; answered now, whatever the engine loop is doing
                    try:
                        reply = {"value": self.engine.info()}
                    except Exception as err:  # noqa: BLE001 - the call fails, the engine serves on
                        reply = {"error": f"{type(err).__name__}: {err}"}
                    self.write({"op": "reply", "id": header["id"], **reply})
                    continue
                with self.cond:
                    self.inbox.append(frame)
                    self.cond.notify()
        except Exception:  # noqa: BLE001 - a broken pipe ends serving as its end would
            logger.exception("reading the server's commands failed")
        with self.cond:
            self.closing = True
            self.cond.notify()

    def run(self) -> None:
        engine = self.engine
        while True:
            with self.cond:
                while not self.inbox and not self.closing and not engine.has_unfinished_requests():
                    if not self.cond.wait(PD_IDLE_GAUGES_S if self.is_pd else None):
                        self._idle_gauges()
                commands, self.inbox = self.inbox, []
                closing = self.closing
            rejected = []
            for header, payload in commands:
                op = header["op"]
                if op == "add":
                    prepared = decode_prepared(header, payload)
                    try:
                        engine.enqueue(prepared)
                    except ValueError as err:
                        rejected.append([prepared.request_id, str(err)])
                        continue
                    self.open.add(prepared.request_id)
                elif op == "abort":
                    engine.abort_request(header["ids"])
                elif op == "close":
                    closing = True
            if closing:
                engine.abort_request(list(self.open))
                engine.close()
                return
            outputs = engine.step()
            deltas = []
            finished = False
            for output in outputs:
                deltas.append(self.deltas.encode(output))
                if output.finished:
                    self.open.discard(output.request_id)
                    finished = True
            frame = {"op": "step", "outputs": deltas, "rejected": rejected}
            now = time.monotonic()
            if (finished or rejected or now - self.stats_sent >= STATS_INTERVAL_S
                    or not engine.has_unfinished_requests()):
                frame["stats"] = encode_stats(engine.stats())
                if self.is_pd:
                    frame["pd"] = self.gauges_sent = pd_gauges(engine)
                self.stats_sent = now
            if deltas or rejected or "stats" in frame:
                self.write(frame)

    def _idle_gauges(self) -> None:
        """An idle PD instance's gauges, when its control threads changed them (a failed transfer's count)."""
        gauges = pd_gauges(self.engine)
        if gauges != self.gauges_sent:
            self.gauges_sent = gauges
            self.write({"op": "step", "outputs": [], "rejected": [], "stats": encode_stats(self.engine.stats()),
                        "pd": gauges})


def pd_gauges(engine) -> dict[str, Any]:
    return {"free": engine.num_free_blocks, "open": engine.num_open_transfers, "counts": dict(engine.counts)}


def _facts(engine, config: EngineConfig) -> dict[str, Any]:
    from jaxserve.runner.model_runner import MAX_BANNED

    inner = getattr(engine, "engine", engine)  # a PDEngine's
    return {"op": "hello", "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
            "sampling_defaults": engine.sampling_defaults, "eos_token_ids": list(inner.eos_token_ids),
            "max_banned": MAX_BANNED, "kv_transfer_address": getattr(engine, "kv_transfer_address", None),
            "pd": pd_gauges(engine) if config.server.pd_role is not None else None}


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the server's thread that started it ends (with the server
    process, as an engine thread would die), so a killed server never leaves its engine serving KV transfers
    or holding the device. (A server that died before this took effect closed the stdin pipe: the loop ends.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    out = claim_stdout()  # the frames'; anything else printed goes to stderr
    inp = sys.stdin.buffer
    frame = read_frame(inp)
    if frame is None:
        return 0
    header = frame[0]
    logging.basicConfig(level=header["log_level"].upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_dict(header["config"])
        engine = build_engine(config)
        hello = _facts(engine, config)
    except Exception as err:  # noqa: BLE001 - reported to the server, which raises it
        if not isinstance(err, ValueError):
            logger.exception("the engine failed to start")
        out.write(encode_frame({"op": "failed", "error": str(err) if isinstance(err, ValueError) else
                                f"{type(err).__name__}: {err}", "kind": "value" if isinstance(err, ValueError)
                                else "internal"}))
        out.flush()
        return 1
    threading.current_thread().name = "jaxserve-engine"  # the engine loop, as the server's engine thread is named
    loop = _EngineLoop(engine, inp, out)
    loop.write(hello)
    try:
        loop.run()
    except Exception as err:  # noqa: BLE001 - reported to the server, which fails its open requests
        logger.exception("the engine loop failed")
        loop.write({"op": "fatal", "error": f"{type(err).__name__}: {err}"})
        return 1
    loop.write({"op": "closed"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
