"""A decode instance writes arrived KV into its reserved blocks paced between steps (PDEngine._install and
_advance_installs): with requests running, about server.kv_install_blocks_per_step blocks a step, at least
one chunk, oldest transfer first, each acked only once its last chunk is written; all at once when no
request runs or the limit is 0; never another chunk into blocks whose reservation ended meanwhile; a
failed write fails its transfer, not the engine."""

from __future__ import annotations

import collections
import types

import numpy as np
import pytest

from jaxserve.pd.engine import PDEngine


class _Reservations:
    def __init__(self, targets: dict[str, list[int]]):
        self.open, self.ready = dict(targets), []

    def targets(self, transfer_id):
        return None if transfer_id in self.ready else self.open.get(transfer_id)

    def mark_ready(self, transfer_id):
        self.ready.append(transfer_id)
        return True

    def abort(self, transfer_id):
        return self.open.pop(transfer_id, None) is not None


def _decode(targets: dict[str, list[int]], per_step: int, busy: bool = True, fail_at: int | None = None):
    writes, attempts = [], []

    def scatter_piece(ids, chunk):
        attempts.append(ids)
        if len(attempts) - 1 == fail_at:
            raise RuntimeError("out of device memory")
        writes.append(list(ids))

    return types.SimpleNamespace(
        engine=types.SimpleNamespace(has_unfinished_requests=lambda: busy),
        install_blocks_per_step=per_step, reservations=_Reservations(targets), counts=collections.Counter(),
        mover=types.SimpleNamespace(scatter_piece=scatter_piece, runner=types.SimpleNamespace(kv_caches=[])),
        _installs=collections.deque(), _install_s=0.0, _install_pieces=0, writes=writes)


def _chunks(*sizes: int) -> list[np.ndarray]:
    return [np.zeros((size, 1)) for size in sizes]


def _step(decode) -> list[list[int]]:
    before = len(decode.writes)
    PDEngine._advance_installs(decode)
    return decode.writes[before:]


def test_installs_are_paced_between_steps_and_acked_when_complete():
    decode = _decode({"a": list(range(10, 21)), "b": [30, 31]}, per_step=4)
    a = PDEngine._install(decode, "a", _chunks(4, 4, 2, 1))
    b = PDEngine._install(decode, "b", _chunks(2))
    assert decode.writes == []  # queued: written by the steps
    assert _step(decode) == [[10, 11, 12, 13]] and not a.done()
    assert _step(decode) == [[14, 15, 16, 17]] and not a.done()
    assert _step(decode) == [[18, 19], [20], [30, 31]]  # 3 blocks, then b's chunk (at least one a step)
    assert a.result() == ("ack", {}) and b.result() == ("ack", {})
    assert decode.reservations.ready == ["a", "b"] and decode.counts["installed"] == 2
    assert decode._install_pieces == 5 and not decode._installs
    assert PDEngine._install(decode, "a", _chunks(11)).result()[0] == "nack"  # a duplicate ready


@pytest.mark.parametrize("per_step, busy", [(4, False), (0, True)])
def test_an_idle_instance_or_no_limit_installs_at_once(per_step, busy):
    decode = _decode({"a": list(range(8))}, per_step=per_step, busy=busy)
    a = PDEngine._install(decode, "a", _chunks(4, 2, 2))
    assert _step(decode) == [[0, 1, 2, 3], [4, 5], [6, 7]] and a.result() == ("ack", {})


def test_a_reservation_ended_mid_install_gets_no_more_writes():
    decode = _decode({"a": list(range(8)), "b": [9]}, per_step=2)
    a = PDEngine._install(decode, "a", _chunks(2, 2, 2, 2))
    b = PDEngine._install(decode, "b", _chunks(1))
    assert _step(decode) == [[0, 1]]
    decode.reservations.abort("a")  # expired or aborted between two steps
    assert _step(decode) == [[9]]
    assert a.result()[0] == "nack" and "while its blocks were written" in a.result()[1]["reason"]
    assert b.result() == ("ack", {}) and decode.reservations.ready == ["b"]


def test_a_wrong_block_count_is_refused_before_any_write():
    decode = _decode({"a": list(range(4))}, per_step=4)
    answer = PDEngine._install(decode, "a", _chunks(2, 1)).result()
    assert answer == ("nack", {"reason": "3 blocks sent for 4 reserved"})
    assert _step(decode) == [] and "a" not in decode.reservations.open


def test_host_bytes_are_cut_as_the_device_path_chunks():
    decode = _decode({"a": list(range(20, 31))}, per_step=0)
    a = PDEngine._install(decode, "a", np.zeros((11, 2)))  # unpacked host bytes: [n, L, *block]
    assert _step(decode) == [list(range(20, 28)), [28, 29], [30]] and a.result() == ("ack", {})


def test_a_failed_write_fails_only_its_transfer():
    decode = _decode({"a": list(range(4)), "b": [7]}, per_step=0, fail_at=1)
    a = PDEngine._install(decode, "a", _chunks(2, 2))
    b = PDEngine._install(decode, "b", _chunks(1))
    assert _step(decode) == [[0, 1], [7]]  # a's second chunk failed; b went on
    assert a.result()[0] == "nack" and "out of device memory" in a.result()[1]["reason"]
    assert "a" not in decode.reservations.open and b.result() == ("ack", {})


def test_a_transfer_id_reserved_again_is_not_written_with_the_old_pieces():
    decode = _decode({"a": [0, 1, 2, 3]}, per_step=2)
    a = PDEngine._install(decode, "a", _chunks(2, 2))
    assert _step(decode) == [[0, 1]]
    decode.reservations.open["a"] = [8, 9, 10, 11]  # aborted, then the same id reserved other blocks
    assert _step(decode) == [] and a.result()[0] == "nack" and decode.reservations.ready == []
