"""Length-prefixed frames between jaxserve's own processes (tokenizer workers, the engine process).

Frame: 8 bytes big-endian (header length, payload length), a UTF-8 JSON header, then the raw payload
(UTF-8 text, token ids as little-endian int32, or another documented byte layout). JSON and raw bytes
only, never pickle: a frame never makes the reader run code.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

import numpy as np

FRAME_HEAD = struct.Struct(">II")
MAX_FRAME_BYTES = 1 << 30


def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    data = json.dumps(header).encode()
    return FRAME_HEAD.pack(len(data), len(payload)) + data + payload


def read_frame(stream: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at a clean end of stream."""
    head = stream.read(FRAME_HEAD.size)
    if not head:
        return None
    if len(head) != FRAME_HEAD.size:
        raise EOFError("truncated frame head")
    header_len, payload_len = FRAME_HEAD.unpack(head)
    if header_len + payload_len > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {header_len + payload_len} bytes exceeds {MAX_FRAME_BYTES}")
    header, payload = stream.read(header_len), stream.read(payload_len)
    if len(header) != header_len or len(payload) != payload_len:
        raise EOFError("truncated frame")
    return json.loads(header), payload


def claim_stdout() -> BinaryIO:
    """For a child process that answers in frames on its stdout: the real stdout, for the frames; anything
    else printed (or logged) from now goes to stderr."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return out


def ids_to_bytes(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def bytes_to_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()
