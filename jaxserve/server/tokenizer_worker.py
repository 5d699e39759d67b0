"""A tokenizer worker process: chat templates, encode and decode, away from the server's GIL.

    python -m jaxserve.server.tokenizer_worker --tokenizer DIR --max-model-len N   (started by TokenizerPool)
    stdout <- hello {"ok": true, "max_chars_per_token": L | null}
    stdin  -> frame {"op": "encode" | "decode", ...} + payload
    stdout <- frame {"ok": true, ...} + payload | {"ok": false, "kind": "template" | "value" | "internal", "error"}

Frames (both directions; jaxserve/framing.py): a JSON header and a raw payload, UTF-8 text or token ids as
little-endian int32. JSON and raw bytes only, never pickle.

encode: the text is the payload, or a chat rendered from header["messages"], whose text contents are
the payload's UTF-8 runs of header["contents"] bytes each (-1: the message keeps its own). A text
longer than max_model_len x L characters is refused unread ("value"); a prompt of max_model_len tokens
or more comes back as its count alone, so the server never holds ids it would refuse. With reply "tokenize" the
payload is /tokenize's finished JSON body (every id), so the server does not serialise a long list.
The worker ends when stdin closes (the server exited or closed the pool); it ignores SIGINT, which a
terminal sends to the whole process group, and runs at a lower priority than the serving process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any, BinaryIO

from jaxserve.framing import bytes_to_ids, claim_stdout, encode_frame, ids_to_bytes, read_frame

NICENESS = 5  # the engine loop and the HTTP event loop come first when cores are scarce

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, tokenizer_dir: str, max_model_len: int):
        from jaxserve.server.char_bound import max_chars_per_token
        from jaxserve.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.max_model_len = max_model_len
        self.max_chars_per_token = max_chars_per_token(json.loads(self.tokenizer.backend.to_str()))

    def handle(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        if header["op"] == "decode":
            text = self.tokenizer.decode(bytes_to_ids(payload), skip_special_tokens=header["skip_special_tokens"])
            return {"ok": True}, text.encode("utf-8", "surrogatepass")
        if header["op"] != "encode":
            raise ValueError(f"unknown op {header['op']!r}")
        chat = "messages" in header
        if chat:
            messages, offset = header["messages"], 0
            for message, size in zip(messages, header["contents"], strict=True):
                if size >= 0:
                    message["content"] = payload[offset: offset + size].decode("utf-8", "surrogatepass")
                    offset += size
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=header["add_generation_prompt"], tools=header.get("tools"),
                chat_template=header.get("chat_template"), continue_final_message=header["continue_final_message"],
                **header.get("template_kwargs", {}))
        else:
            text = payload.decode("utf-8", "surrogatepass")  # a lone surrogate is refused below, by name
        bound = self.max_chars_per_token
        if bound is not None and len(text) > self.max_model_len * bound:
            what = "the rendered chat" if chat else "the prompt"
            raise ValueError(f"{what} is {len(text)} characters, more than max_model_len={self.max_model_len} "
                             f"tokens of at most {bound} characters each can hold ({self.max_model_len * bound}); "
                             f"shorten it")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"the text holds a lone surrogate ({err.reason}); send valid Unicode") from None
        ids = self.tokenizer.encode(text, add_special_tokens=header["add_special_tokens"])
        if header.get("reply") == "tokenize":
            token_strs = ([self.tokenizer.id_to_token(i) for i in ids] if header.get("return_token_strs")
                          else None)
            body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": token_strs}
            return {"ok": True}, json.dumps(body).encode()
        if len(ids) >= self.max_model_len:
            return {"ok": True, "count": len(ids)}, b""
        return {"ok": True, "count": len(ids), **({"prompt": text} if chat else {})}, ids_to_bytes(ids)


def serve(worker: Worker, inp: BinaryIO, out: BinaryIO) -> None:
    from jaxserve.tokenizer import ChatTemplateError

    while (frame := read_frame(inp)) is not None:
        try:
            reply = worker.handle(*frame)
        except ChatTemplateError as err:
            reply = {"ok": False, "kind": "template", "error": str(err)}, b""
        except (ValueError, TypeError) as err:
            reply = {"ok": False, "kind": "value", "error": str(err)}, b""
        except Exception as err:  # noqa: BLE001 - the request fails; the worker keeps serving
            logger.exception("tokenizer worker: request failed")
            reply = {"ok": False, "kind": "internal", "error": f"{type(err).__name__}: {err}"}, b""
        out.write(encode_frame(*reply))
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.server.tokenizer_worker")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICENESS)
    out = claim_stdout()  # the frames'; anything else printed goes to stderr
    try:
        worker = Worker(args.tokenizer, args.max_model_len)
    except Exception as err:  # noqa: BLE001 - reported to the server, which fails to start with it
        out.write(encode_frame({"ok": False, "kind": "internal", "error": f"{type(err).__name__}: {err}"}))
        out.flush()
        return 1
    out.write(encode_frame({"ok": True, "max_chars_per_token": worker.max_chars_per_token}))
    out.flush()
    serve(worker, sys.stdin.buffer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
