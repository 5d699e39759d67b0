"""PD block bookkeeping: decode reservations and prefill leases return both pools to their starting counts
after any interleaving of reserve / ready / claim / admit / ack / abort / timeout (hypothesis), and late or
duplicate events are ignored."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.pd.reservations import DecodeReservations, PrefillLeases, Refused, State
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

BLOCK = 4
PROMPTS = [list(range(1, 14)), list(range(1, 10)) + [50, 51, 52], [7] * 3, list(range(20, 37))]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_request(kv: KVCacheManager, request_id: str, prompt: list[int]) -> Request:
    """Admit a request as the scheduler does (prefix hit, then its blocks); None when blocks ran out."""
    request = Request(request_id, prompt, SamplingParams(max_tokens=1))
    ids, hit = kv.get_computed_blocks(request)
    request.num_computed_tokens = hit
    if kv.allocate_slots(request, len(prompt) - hit, ids) is None:
        request.num_computed_tokens = 0  # as the scheduler does on a refusal: its hit blocks were not taken
        kv.free(request)
        return None
    request.num_computed_tokens = len(prompt)
    return request


def _check_pool(kv: KVCacheManager) -> None:
    pool = kv.pool
    held = sum(1 for block in pool.blocks[1:] if block.ref_cnt > 0)
    assert held + pool.num_free_blocks == pool.num_blocks - 1


def test_reserve_ready_claim_admit_returns_the_pool():
    clock = Clock()
    kv = KVCacheManager(16, BLOCK, hash_seed=1)
    res = DecodeReservations(kv, hold_s=5.0, clock=clock)
    start = kv.num_free_blocks
    prompt = PROMPTS[0]  # 13 tokens: 3 usable blocks
    r = res.reserve("a", prompt, None, timeout_s=2.0)
    assert r.skip == 0 and len(r.target_ids) == 3 and kv.num_free_blocks == start - 3
    assert res.reserve("a", prompt, None, timeout_s=2.0) is r  # a retried reserve: the same reservation
    targets = res.targets("a")
    assert res.mark_ready("a") and res.targets("a") is None  # a duplicate ready is ignored
    assert not res.claim("a", "req", PROMPTS[1], None)  # another prompt does not take it
    assert res.claim("a", "req", prompt, None) and res.abort("a") is False  # claimed: a late abort is ignored
    request = _run_request(kv, "req", prompt)
    assert kv.get_block_ids("req")[:3] == targets  # the transferred blocks are the request's prefix
    assert request.num_computed_tokens == 13
    assert res.release_claims(lambda rid: False) == 1 and len(res) == 0
    kv.free(request)
    assert kv.num_free_blocks == start
    _check_pool(kv)


def test_cached_prefix_is_pinned_not_transferred_and_timeouts_free():
    clock = Clock()
    kv = KVCacheManager(16, BLOCK, hash_seed=1)
    start = kv.num_free_blocks
    kv.free(_run_request(kv, "warm", PROMPTS[0][:9]))  # blocks 0-1 of PROMPTS[0] cached
    res = DecodeReservations(kv, hold_s=5.0, clock=clock)
    r = res.reserve("b", PROMPTS[0], None, timeout_s=2.0)
    assert r.skip == 2 and len(r.target_ids) == 1
    clock.now = 2.5
    assert res.expire() == ["b"] and res.targets("b") is None and not res.mark_ready("b")
    assert kv.num_free_blocks == start


def test_refused_when_blocks_run_out_holds_nothing():
    kv = KVCacheManager(4, BLOCK, hash_seed=1)  # 3 usable blocks
    res = DecodeReservations(kv, hold_s=5.0, headroom_blocks=1)
    with pytest.raises(Refused, match="free KV blocks"):
        res.reserve("c", PROMPTS[3], None, timeout_s=1.0)  # 4 usable blocks needed
    assert kv.num_free_blocks == 3 and len(res) == 0


def test_prefill_lease_pins_until_release_or_deadline():
    clock = Clock()
    kv = KVCacheManager(16, BLOCK, hash_seed=2)
    leases = PrefillLeases(kv, clock=clock)
    start = kv.num_free_blocks
    assert leases.pin("x", PROMPTS[0], None, 0, 1.0) is None  # nothing cached: nothing to serve
    kv.free(_run_request(kv, "p", PROMPTS[0]))
    ids = leases.pin("x", PROMPTS[0], None, 1, 1.0)
    assert len(ids) == 2 and kv.num_free_blocks == start - 2
    assert leases.pin("x", PROMPTS[0], None, 0, 1.0) is None  # held already
    assert leases.release("x") and not leases.release("x")  # a duplicate ack is ignored
    assert leases.pin("y", PROMPTS[0], None, 0, 1.0) is not None
    clock.now = 1.0
    assert leases.expire() == ["y"] and kv.num_free_blocks == start


OPS = st.lists(st.tuples(st.sampled_from(["reserve", "ready", "claim", "admit", "finish", "pin", "ack", "abort",
                                          "tick"]), st.integers(0, len(PROMPTS) - 1)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS)
@example([("reserve", 1), ("admit", 0), ("admit", 3), ("admit", 1)])  # r1 hits r0's blocks, then runs out
def test_any_interleaving_returns_both_pools_to_their_start(ops):
    clock = Clock()
    d_kv = KVCacheManager(12, BLOCK, hash_seed=3)
    p_kv = KVCacheManager(12, BLOCK, hash_seed=4)
    d_start, p_start = d_kv.num_free_blocks, p_kv.num_free_blocks
    for i, prompt in enumerate(PROMPTS):  # the prefill side computed every prompt once
        request = _run_request(p_kv, f"p{i}", prompt)
        if request is not None:
            p_kv.free(request)
    res = DecodeReservations(d_kv, hold_s=3.0, clock=clock)
    leases = PrefillLeases(p_kv, clock=clock)
    running: dict[str, Request] = {}
    claimed: dict[str, int] = {}
    for op, i in ops:
        tid, rid = f"t{i}", f"r{i}"
        if op == "reserve":
            try:
                res.reserve(tid, PROMPTS[i], None, timeout_s=2.0)
            except Refused:
                pass
        elif op == "ready":
            if res.targets(tid) is not None:
                assert res.mark_ready(tid)
            else:
                assert not res.mark_ready(tid)
        elif op == "claim" and rid not in running:
            if res.claim(tid, rid, PROMPTS[i], None):
                claimed[tid] = i
        elif op == "admit" and rid not in running:
            request = _run_request(d_kv, rid, PROMPTS[i])
            if request is not None:
                running[rid] = request
            res.release_claims(lambda r: r not in running)
        elif op == "finish" and rid in running:
            d_kv.free(running.pop(rid))
        elif op == "pin":
            leases.pin(tid, PROMPTS[i], None, 0, 2.0)
        elif op == "ack":
            leases.release(tid)
        elif op == "abort":
            res.abort(tid)
            leases.release(tid)
        elif op == "tick":
            clock.now += 1.0
            res.expire()
            leases.expire()
        _check_pool(d_kv)
        _check_pool(p_kv)
        for reservation in res._open.values():  # a claim only ever follows a ready
            assert reservation.state in (State.RESERVED, State.READY, State.CLAIMED)
    for request in running.values():
        d_kv.free(request)
    res.release_claims(lambda r: False)
    clock.now += 100
    res.expire()
    leases.expire()
    assert len(res) == 0 and len(leases) == 0
    assert d_kv.num_free_blocks == d_start and p_kv.num_free_blocks == p_start
