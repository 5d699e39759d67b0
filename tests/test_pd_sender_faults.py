"""A prefill instance's sender threads (jaxserve/pd/engine.py) never take its engine down: a reserve whose
deadline passed before a sender thread got to it (a backed-up sender pool on a busy machine) fails as a
timeout instead of calling the socket layer with a negative timeout, and any exception from a sender, of
whatever type, ends only its own transfer: the engine loop that reads the senders' results goes on."""

from __future__ import annotations

import concurrent.futures
import time
import types

import pytest

from jaxserve.pd import protocol as proto
from jaxserve.pd.engine import PDEngine, _Outgoing


def _outgoing(deadline: float) -> _Outgoing:
    return _Outgoing("ab" * 16 + ".0", "127.0.0.1:9", "req-0", [1, 2, 3], None, deadline)


def _failed_future(error: BaseException) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_exception(error)
    return future


def _prefill(resolved: list):
    return types.SimpleNamespace(key=proto.derive_key(None), mover=types.SimpleNamespace(layout={}),
                                 _resolve=lambda out, outcome, tell_decode: resolved.append((outcome, tell_decode)))


def test_a_reserve_past_its_deadline_fails_as_a_timeout_without_sending():
    with pytest.raises(proto.ProtocolError, match="deadline passed before the reserve was sent"):
        PDEngine._send_reserve(_prefill([]), _outgoing(time.monotonic() - 0.5))


@pytest.mark.parametrize("error, outcome", [
    (proto.ProtocolError("no answer"), ("timeout", True)),
    (ConnectionRefusedError("gone"), ("unreachable", False)),
    (ValueError("Timeout value out of range"), ("failed", True)),
])
def test_a_failed_reserve_ends_its_transfer_only(error, outcome):
    resolved = []
    out = _outgoing(time.monotonic() + 5)
    out.reserve = _failed_future(error)
    PDEngine._start_send(_prefill(resolved), out)  # returns: the engine loop goes on
    assert resolved == [outcome]


@pytest.mark.parametrize("error", [ConnectionResetError("reset"), RuntimeError("a sender bug")])
def test_a_failed_ready_ends_its_transfer_only(error):
    resolved = []
    out = _outgoing(time.monotonic() + 5)
    out.send = _failed_future(error)
    PDEngine._finish_send(_prefill(resolved), out)
    assert resolved == [("failed", True)]
