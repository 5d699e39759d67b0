"""Connection timeouts: uvicorn's h11 protocol with idle and stalled connections closed.

    connection opened, or a response finished --> idle: closed after server.keep_alive_timeout_s
        (uvicorn times only the gap after a response; here a connection that never sends a byte too)
    first byte of a request --> its head and body must be whole within server.read_timeout_s, else
        408 (when no response has started) and the connection is closed (a client that sends half a
        request and stops holds nothing for long); the app's own time (generation) is not limited

NOTE: uvicorn cancels its keep-alive timer on any byte received, so a partial request head would
otherwise keep a connection (and its buffers) forever.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.server.errors import error_body

_WAITING_FOR_REQUEST = (h11.IDLE, h11.SEND_BODY)  # their_state while a request is not whole yet


class GuardedH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0  # set per server by with_read_timeout

    @classmethod
    def with_read_timeout(cls, read_timeout_s: float) -> type[GuardedH11Protocol]:
        return type(cls.__name__, (cls,), {"read_timeout_s": read_timeout_s})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self.conn.their_state is h11.IDLE:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        super().data_received(data)
        if self.conn.their_state not in _WAITING_FOR_REQUEST or self.transport.is_closing():
            self._cancel_read_deadline()

    def on_response_complete(self) -> None:
        self._cancel_read_deadline()
        super().on_response_complete()

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in _WAITING_FOR_REQUEST:
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            body = error_body(408, f"the request did not arrive whole within server.read_timeout_s="
                                   f"{self.read_timeout_s:g} s; send it at once")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                                 + body)
        self.transport.close()
