"""Swap preemption: a preempted request's blocks go to the host tier pinned and come back into fresh device
blocks; outputs equal an unconstrained engine's under swap and recompute, with overlap and without; the
cost model picks between them; a host tier without room falls back to recompute."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_tiers.host_pool import HostKVPool
from jaxserve.core.kv_tiers.link import SwapKey
from jaxserve.core.kv_tiers.tiers import KVTiers
from jaxserve.core.preemption import PreemptionCost
from tests.conftest import ROOT
from tests.test_kv_cache_manager import FakeRequest, start

pytestmark = pytest.mark.cpu_test

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
BLOCK_GIB = 8192 / (1 << 30)  # one block of the embedded model
PROMPTS = [f"{a}+{b}=" for a, b in [(12345, 678), (4321, 87654), (99, 12), (5555, 4444), (31415, 9265),
                                    (271, 82818), (8, 9), (60606, 7)]] * 2
# Greedy, and seeded sampling (its noise is keyed by the request's seed and position: a resumed request
# must continue exactly where it stopped).
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)] * (len(PROMPTS) // 2)
SMALL = dict(num_blocks=12, token_buckets=[16, 64], request_buckets=[4, 16], max_num_seqs=16, max_num_batched_tokens=64)


def make_llm(**overrides) -> LLM:
    """Not precompiled: each engine compiles the few step shapes it runs, which the module's other engines
    of its pool size then share."""
    return LLM(config=load_config(TINY_CONFIG), progress=False, precompile=False, **overrides)


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return token_ids(make_llm().generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_and_recompute_preemption_match_an_unconstrained_engine(reference, mode, overlap):
    llm = make_llm(host_kv_gib=64 * BLOCK_GIB, preemption_mode=mode, async_scheduling=overlap, **SMALL)
    engine = llm.engine
    host = engine.kv_transfer.tiers.host
    assert token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    stats = engine.kv_cache.stats
    assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if mode == "swap":
        assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out
    else:
        assert stats.swaps_out == 0
    engine.kv_transfer.poll(engine.kv_cache.tier_link, wait=True)
    # every device block free again; the host holds no swapped block and nothing pinned
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks - 1
    host.check()
    assert not any(isinstance(key, SwapKey) for key in host.keys()) and host.num_in_transit == 0
    assert host.num_reservable == host.num_slots


def test_auto_mode_picks_by_cost():
    cost = PreemptionCost(copy_bytes_per_s=1e9, prefill_tokens_per_s=1e4)
    # 16 tokens in 1 block of 1 MB: 2 ms to move both ways, 1.6 ms to recompute
    assert not cost.prefer_swap(1, 1 << 20, 16)
    assert cost.prefer_swap(1, 1 << 20, 32)
    assert not cost.prefer_swap(1, 1 << 20, 0)  # (shared blocks stay on the device: nothing to recompute)
    fast_prefill = make_llm(host_kv_gib=64 * BLOCK_GIB, **SMALL)
    fast_prefill.engine.scheduler.preemption_cost = PreemptionCost(prefill_tokens_per_s=1e15)
    fast_prefill.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert fast_prefill.engine.scheduler.num_preemptions > 0
    assert fast_prefill.engine.kv_cache.stats.swaps_out == 0
    # the default rates on the embedded model (2 KiB of KV a token): moving is far cheaper
    auto = make_llm(host_kv_gib=64 * BLOCK_GIB, **SMALL)
    auto.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert auto.engine.kv_cache.stats.swaps_out > 0


def test_swap_mode_needs_a_host_tier():
    with pytest.raises(ValueError, match="preemption_mode=swap .* set cache.host_kv_gib > 0"):
        make_llm(preemption_mode="swap", **SMALL)


# ---------------------------------------------------------------- the manager's side


def _manager(host_slots: int) -> KVCacheManager:
    tiers = KVTiers(HostKVPool(host_slots, (2,), np.float32), block_tokens=2)
    return KVCacheManager(8, 2, hash_seed=1, tiers=tiers)


def test_swap_keeps_the_partial_block_pins_it_and_frees_the_host_slots_on_resume():
    manager = _manager(4)
    link, host = manager.tier_link, manager.tiers.host
    request = FakeRequest("a", [1, 2, 3, 4, 5])
    start(manager, request)
    block_ids = manager.get_block_ids("a")
    assert manager.swap_out(request, 5)  # 3 blocks, the last holding one token
    moves = link.take()
    assert moves.save_block_ids == block_ids and all(isinstance(k, SwapKey) for k in moves.save_keys)
    manager.free(request)
    request.num_computed_tokens = 0
    assert manager.swapped_tokens(request) == 5 and not manager.swap_ready(request)
    data = np.arange(6, dtype=np.float32).reshape(3, 2)
    link.finish_saves(moves.save_keys, data)
    assert manager.swap_ready(request) and host.num_reservable == 1  # landed pinned
    assert not manager.swap_out(FakeRequest("b", [9] * 4), 4)  # (b holds no blocks: nothing to swap)
    request.all_token_ids.append(6)
    request.num_computed_tokens = 5
    new_ids = manager.swap_in(request, 1)
    assert len(new_ids) == 3 and manager.swapped_tokens(request) == 0
    moves = link.take()
    assert moves.load_block_ids == sorted(new_ids) and np.array_equal(moves.load_data, data[np.argsort(new_ids)])
    assert host.num_reservable == host.num_slots and host.num_present == 0
    host.check()


def test_swap_falls_back_when_the_host_is_full_and_a_dropped_swap_frees_its_slots():
    manager = _manager(2)
    link, host = manager.tier_link, manager.tiers.host
    request = FakeRequest("a", [1, 2, 3, 4, 5])
    start(manager, request)
    assert not manager.swap_out(request, 5)  # 3 blocks, 2 slots: recompute instead, nothing reserved
    assert host.num_reservable == 2 and not link.take()
    assert manager.swap_out(request, 4)
    moves = link.take()
    manager.free(request)
    manager.drop_swap(request)  # aborted while its copies were in flight
    link.finish_saves(moves.save_keys, np.zeros((2, 2), np.float32))
    assert host.num_present == 0 and host.num_reservable == 2
    host.check()
