"""A waiting request whose prefix is still coming up from disk (or whose swapped blocks are still on their
way to host) does not hold up the requests behind it, and it starts, with its hit, once its blocks landed;
the queue keeps its order otherwise."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_types import RunnerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from tests.test_kv_cache_manager import FakeRequest
from tests.test_kv_tiers_store import SHAPE, make_tiers

pytestmark = pytest.mark.cpu_test

SIZE = 2
SEED = 11
LOADING = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks on disk


def block_keys(tokens: list[int]) -> list[bytes]:
    manager = KVCacheManager(16, SIZE, hash_seed=SEED)
    request = FakeRequest("k", tokens)
    manager.get_computed_blocks(request)
    return list(manager._requests["k"].block_hashes)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_requests_behind_a_loading_prefix_are_scheduled(tmp_path, policy):
    tiers = make_tiers(tmp_path / "kv", host_slots=8, disk_blocks=64, block_tokens=SIZE)
    for key in block_keys(LOADING):
        tiers.disk.write(key, np.full(SHAPE, 1.0, np.float32))
    manager = KVCacheManager(32, SIZE, hash_seed=SEED, tiers=tiers)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, policy=policy), manager, 64)
    gate = threading.Event()
    tiers._io.submit(gate.wait)  # the disk IO thread is busy: the reads queue behind this
    requests = [Request(name, tokens, SamplingParams(max_tokens=2), arrival_time=t)
                for t, (name, tokens) in enumerate([("loading", LOADING), ("b", [9, 9, 9]), ("c", [8, 8])])]
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert [item.request_id for item in first.scheduled] == ["b", "c"]
    assert requests[0].status == RequestStatus.WAITING and scheduler.waiting.peek() is requests[0]
    assert len(scheduler.waiting) == 1
    gate.set()
    tiers.poll(wait=True)  # the three blocks landed on host
    second = scheduler.schedule()
    assert [item.request_id for item in second.scheduled] == ["loading"]
    assert second.scheduled[0].num_computed_tokens == 6  # its prefix, loaded from the tiers
    assert manager.stats.disk_hits == 6
    tiers.close()


def test_a_swapped_request_waits_aside_until_its_blocks_landed(tmp_path):
    tiers = make_tiers(tmp_path / "kv", host_slots=8, disk_blocks=None, block_tokens=SIZE)
    manager = KVCacheManager(6, SIZE, hash_seed=SEED, tiers=tiers)  # 5 usable blocks
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, preemption_mode="swap"),
                          manager, 64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    early = Request("early", [1, 2, 3], params, arrival_time=0)
    late = Request("late", [4, 5, 6], params, arrival_time=1)
    scheduler.add_request(early)
    scheduler.add_request(late)
    link = manager.tier_link
    out = scheduler.schedule()  # both prefill: 2 blocks each
    for _ in range(2):  # two decode steps; the second needs a third block each, and only one is free
        scheduler.update_from_output(out, RunnerOutput([r.request_id for r in (early, late)], [7, 7]))
        out = scheduler.schedule()
    assert late.status == RequestStatus.PREEMPTED and manager.swapped_tokens(late) == 4
    moves = link.take()  # the swap's copies: dispatched, not landed yet
    assert len(moves.save_keys) == 2
    scheduler.add_request(Request("newcomer", [3, 3], params, arrival_time=2))
    scheduler.update_from_output(out, RunnerOutput(["early"], [7]))
    out = scheduler.schedule()
    assert [item.request_id for item in out.scheduled] == ["newcomer"] and late.status == RequestStatus.PREEMPTED
    assert scheduler.waiting.peek() is late  # still first in line
    link.finish_saves(moves.save_keys, np.zeros((2, *SHAPE), np.float32))
    scheduler.abort_requests(["early", "newcomer"])  # room for it
    out = scheduler.schedule()
    assert [(item.request_id, item.num_computed_tokens, item.num_new_tokens) for item in out.scheduled] == [
        ("late", 4, 1)]  # its 4 computed tokens loaded back; the last known one fed again for its logits
    loads = link.take()
    assert loads.load_block_ids == sorted(out.scheduled[0].new_block_ids[:2])
    # the swap's host slots are free again; in transit: write-backs of cached blocks its fresh blocks evicted
    assert tiers.host.num_present == 0 and all(isinstance(key, bytes) for key in loads.save_keys)
    assert tiers.host.num_reservable == tiers.host.num_slots - len(loads.save_keys)


def test_a_prefix_on_host_is_admitted_at_once_and_loads_every_block(tmp_path):
    """A request whose prefix is present on host is not held aside: its hit covers the host blocks, each
    given a fresh device block, and the next take() loads every one of them under its own key."""
    tiers = make_tiers(tmp_path / "kv", host_slots=8, disk_blocks=8, block_tokens=SIZE)
    keys = block_keys(LOADING)
    for i, key in enumerate(keys):  # 3 full blocks present on host
        assert tiers.host.put(key, np.full(SHAPE, float(i), np.float32))
    manager = KVCacheManager(32, SIZE, hash_seed=SEED, tiers=tiers)
    request = FakeRequest("a", LOADING)
    assert not manager.loading_prefix(request)
    block_ids, hit = manager.get_computed_blocks(request)
    assert hit == 3 * SIZE
    moves = manager.tier_link.take()
    assert sorted(moves.load_block_ids) == sorted(block_ids[:3]) and not moves.save_block_ids
    # each target block gets its own key's data
    for block_id, data in zip(moves.load_block_ids, moves.load_data):
        assert np.all(np.asarray(data) == float(block_ids.index(block_id)))
    stats = manager.stats
    assert stats.host_hits == 3 * SIZE and stats.host_bytes_out == 3 * tiers.host.block_bytes


LONG = list(range(1, 12))  # 5 full blocks (the last token is always computed)


def test_a_host_prefix_past_the_step_budget_waits_while_it_loads_a_budget_at_a_time(tmp_path):
    """With a load budget of 2 blocks per take(): a request whose 5 host blocks exceed it waits (loading)
    while they are loaded two per take() into device blocks registered under their keys, each take()
    carrying at most the budget; the last one loads with its admission, whose hit covers all 5 blocks, each
    filled from its own key's host block."""
    tiers = make_tiers(tmp_path / "kv", host_slots=8, disk_blocks=None, block_tokens=SIZE)
    keys = block_keys(LONG)
    for i, key in enumerate(keys):
        assert tiers.host.put(key, np.full(SHAPE, float(i), np.float32))
    manager = KVCacheManager(32, SIZE, hash_seed=SEED, tiers=tiers)
    link = manager.tier_link
    link.load_budget = 2
    request = FakeRequest("a", LONG)
    loaded: dict[int, float] = {}  # device block id -> the value its load wrote
    takes = []
    while manager.loading_prefix(request):
        moves = link.take()
        takes.append(len(moves.load_block_ids))
        loaded.update((i, float(np.asarray(d).flat[0])) for i, d in zip(moves.load_block_ids, moves.load_data))
        assert len(takes) <= 3
    assert takes == [2, 2]
    block_ids, hit = manager.get_computed_blocks(request)
    assert hit == 5 * SIZE
    moves = link.take()
    assert len(moves.load_block_ids) == 1
    loaded.update((i, float(np.asarray(d).flat[0])) for i, d in zip(moves.load_block_ids, moves.load_data))
    assert [loaded[i] for i in block_ids] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert manager.stats.host_hits == 5 * SIZE
    assert tiers.host.num_present == tiers.host.num_reservable - 3 == 5  # none left pinned, 3 slots free
    tiers.host.check()


def test_a_host_prefix_too_long_for_the_free_blocks_is_admitted_with_a_budget_of_loads(tmp_path):
    """When the host blocks could never all be on the device at once (fewer free blocks than they are),
    the request is not held: its hit takes as many loads as the budget allows and the rest is computed."""
    tiers = make_tiers(tmp_path / "kv", host_slots=8, disk_blocks=None, block_tokens=SIZE)
    keys = block_keys(LONG)
    for key in keys:
        assert tiers.host.put(key, np.full(SHAPE, 1.0, np.float32))
    manager = KVCacheManager(5, SIZE, hash_seed=SEED, tiers=tiers)  # 4 usable blocks
    manager.tier_link.load_budget = 2
    request = FakeRequest("a", LONG)
    assert not manager.loading_prefix(request)
    _, hit = manager.get_computed_blocks(request)
    assert hit == 2 * SIZE and len(manager.tier_link.take().load_block_ids) == 2


def test_a_host_block_evicted_by_its_own_prefix_disk_reads_is_not_preloaded(tmp_path):
    """The prefix's disk reads take host slots, and with none free they evict the least recently used
    present block, which may be one of this prefix's own host blocks found a moment before: it is not
    preloaded (pinning an absent key would fail the schedule), and the request waits for its reads."""
    tiers = make_tiers(tmp_path / "kv", host_slots=4, disk_blocks=64, block_tokens=SIZE)
    tokens = list(range(1, 10))  # 4 full blocks
    keys = block_keys(tokens)
    for i, key in enumerate(keys[:2]):  # the first two on host, the last two on disk
        assert tiers.host.put(key, np.full(SHAPE, float(i), np.float32))
    for key in keys[2:]:
        tiers.disk.write(key, np.full(SHAPE, 2.0, np.float32))
    assert tiers.host.reserve(b"x" * 32) is not None  # a save in flight holds the third slot
    manager = KVCacheManager(32, SIZE, hash_seed=SEED, tiers=tiers)
    manager.tier_link.load_budget = 1
    request = FakeRequest("a", tokens)
    assert manager.loading_prefix(request)  # the reads started; the second one evicted keys[0]
    assert tiers.host.state(keys[0]) == "absent"
    moves = manager.tier_link.take()
    assert len(moves.load_block_ids) <= 1
    tiers.host.check()
    tiers.close()
