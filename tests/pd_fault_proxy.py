"""A TCP proxy in front of a decode instance's KV transfer endpoint that injects faults into the PD control
protocol by message type (test-only; the instances know nothing of it):

    drop        read the message, close the connection unanswered (forward nothing)
    delay       forward it after `delay_s`
    truncate    forward the frame and half its payload, then close both sides
    drop_reply  forward it, read the reply, close without passing the reply on
    duplicate   forward it twice (two connections); the first reply is passed on, the second recorded
    hold        keep it (forward nothing) until the proxy closes: a sender killed meanwhile dies mid-transfer
    hold_forward  keep it until release(), then forward it (a sender killed meanwhile is gone when the
                endpoint acts on it: a device-path "ready" then names blocks nobody can serve)

Messages of other types pass through. `seen` lists the message types in arrival order; `replies` the
reply types the endpoint sent.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

from jaxserve.pd import protocol as proto


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[dict, bytes]:
    """(header, the whole frame's bytes) of one message, unchecked."""
    prefix = _read(sock, 8)
    (length,) = struct.unpack(">I", prefix[4:])
    body = _read(sock, length)
    header = json.loads(body)
    rest = _read(sock, 32 + header.get("payload_bytes", 0))
    return header, prefix + body + rest


class FaultProxy:
    def __init__(self, target: str, faults: dict[str, str], delay_s: float = 0.0):
        self.target = proto.split_address(target)
        self.faults = faults
        self.delay_s = delay_s
        self.seen: list[str] = []
        self.replies: list[str] = []
        self._closed = threading.Event()
        self._released = threading.Event()
        self._cond = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        self._thread.join()
        self._listener.close()

    def release(self) -> None:
        self._released.set()

    def wait_for(self, kind: str, timeout_s: float) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: kind in self.seen, timeout_s), f"no {kind} arrived: {self.seen}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _exchange(self, frame: bytes) -> bytes:
        with socket.create_connection(self.target, timeout=30) as upstream:
            upstream.sendall(frame)
            header, reply = read_frame(upstream)
        self.replies.append(header["type"])
        return reply

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                header, frame = read_frame(client)
            except (ConnectionError, OSError, ValueError):
                return
            with self._cond:
                self.seen.append(header["type"])
                self._cond.notify_all()
            action = self.faults.get(header["type"])
            try:
                if action == "drop":
                    return
                if action == "hold":
                    self._closed.wait()
                    return
                if action == "truncate":
                    size = header.get("payload_bytes", 0)
                    with socket.create_connection(self.target, timeout=30) as upstream:
                        upstream.sendall(frame[:len(frame) - size + size // 2])
                    return
                if action == "delay":
                    time.sleep(self.delay_s)
                if action == "hold_forward":
                    self._released.wait()
                reply = self._exchange(frame)
                if action == "duplicate":
                    self._exchange(frame)
                if action != "drop_reply":
                    client.sendall(reply)
            except (ConnectionError, OSError):
                return
