"""KV cache tiers with speculative decoding (n-gram, a draft model, an EAGLE head), on the embedded model:
greedy tokens identical to an engine without speculation and without tiers while blocks go to the host tier
(and disk) and come back; a block carries the proposer's K/V with the target's (kv_transfer.CacheSet), so the
proposer guesses after a load exactly as after recomputing (same guesses, same acceptance); swap preemption
of requests whose guesses are in flight; every block returned."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from jaxserve.core import scheduler as scheduler_module
from jaxserve.core.kv_tiers.link import SwapKey
from tests.conftest import ROOT, TINY_MODEL

pytestmark = pytest.mark.cpu_test

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
TINY_EAGLE = TINY_MODEL.parent / "tiny-adder-eagle"
BLOCK_GIB = 8192 / (1 << 30)  # one block of the embedded model's own caches
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# Prompts of two or three full blocks, several sharing openings; each round evicts the last one's blocks.
PROMPTS = [f"{a}+{b}=" for a, b in [(12345, 678), (12345, 999), (4321, 87654), (99, 12), (5555, 4444),
                                    (12345, 678), (31415, 9265), (271, 82818), (4321, 87654)]]
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
         # the target drafting for itself: every guess is right while the draft's K/V is
         "draft_model": {"method": "draft_model", "model": str(TINY_MODEL), "num_speculative_tokens": 2},
         "eagle": {"method": "eagle", "model": str(TINY_EAGLE), "num_speculative_tokens": 2}}


def make_llm(**overrides) -> LLM:
    return LLM(config=load_config(TINY_CONFIG), progress=False, precompile=False, **overrides)


def run_rounds(llm: LLM) -> list[list[int]]:
    """Each prompt alone, twice over: later requests find earlier prefixes evicted from the device."""
    return [out.outputs[0].token_ids for prompt in PROMPTS * 2
            for out in llm.generate([prompt], GREEDY, use_tqdm=False)]


def assert_all_returned(llm: LLM) -> None:
    engine = llm.engine
    engine.kv_transfer.poll(engine.kv_cache.tier_link, wait=True)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks - 1
    host = engine.kv_transfer.tiers.host
    host.check()
    assert not any(isinstance(key, SwapKey) for key in host.keys()) and host.num_in_transit == 0
    assert host.num_reservable == host.num_slots


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return run_rounds(make_llm())


@pytest.mark.parametrize("method", list(SPECS))
def test_tiers_with_each_proposer_match_no_speculation_and_no_tiers(reference, method, tmp_path):
    tiers = dict(host_kv_gib=64 * BLOCK_GIB, prefix_hash_seed=1)
    if method == "draft_model":  # (a small host tier over a disk tier: blocks come back from disk too)
        tiers = dict(host_kv_gib=8 * BLOCK_GIB, disk_kv_path=str(tmp_path / "kv"), disk_kv_gib=0.01, prefix_hash_seed=1)
    llm = make_llm(num_blocks=9, speculative_config=SPECS[method], **tiers)
    assert run_rounds(llm) == reference
    stats = llm.engine.stats()
    kv = stats.kv_cache
    assert kv.host_hits > 0 and kv.host_bytes_in > 0 and kv.host_bytes_out > 0
    assert stats.spec_draft_tokens > 0
    sets = llm.engine.kv_transfer.sets
    assert len(sets) == (1 if method == "ngram" else 2)  # the proposer's caches move with the target's
    assert llm.engine.kv_transfer.tiers.host.block_shape == (sum(s.size for s in sets),)
    if method == "draft_model":
        assert kv.disk_hits > 0
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    if method == "eagle":  # loaded blocks give the head the K/V that recomputing them gives it
        without = make_llm(num_blocks=9, speculative_config=SPECS[method])
        assert run_rounds(without) == reference
        plain = without.engine.stats()
        assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (plain.spec_draft_tokens,
                                                                          plain.spec_accepted_tokens)
    assert_all_returned(llm)


SWAP_PROMPTS = [f"{a}+{b}=" for a, b in [(12345, 678), (4321, 87654), (99, 12), (5555, 4444)]]
SWAP_PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SMALL = dict(num_blocks=16, token_buckets=[16, 64], request_buckets=[4, 16], max_num_seqs=16,
             max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def swap_reference() -> list[list[int]]:
    return [out.outputs[0].token_ids for out in make_llm().generate(SWAP_PROMPTS, SWAP_PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("method", list(SPECS))
def test_swap_preemption_with_guesses_in_flight(swap_reference, method, monkeypatch):
    """Overlap: a request whose guesses are in the step in flight is the victim whenever one runs (its
    guesses' K/V slots are past the tokens swapped out; the in-flight step's tokens are dropped)."""
    monkeypatch.setattr(scheduler_module, "_victim_key",
                        lambda r: (bool(r.draft_token_ids), r.priority, r.arrival_time))
    llm = make_llm(host_kv_gib=64 * BLOCK_GIB, preemption_mode="swap", async_scheduling=True,
                   speculative_config={**SPECS[method], "num_speculative_tokens": 3}, **{**SMALL, "num_blocks": 14})
    scheduler = llm.engine.scheduler
    in_flight = []
    preempt = scheduler._preempt

    def record(request):
        in_flight.append(bool(request.draft_token_ids))
        preempt(request)

    scheduler._preempt = record
    outputs = llm.generate(SWAP_PROMPTS, SWAP_PARAMS, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == swap_reference
    kv = llm.engine.kv_cache.stats
    assert any(in_flight), "a request with guesses in flight was meant to be preempted"
    assert kv.swaps_out == len(in_flight) and kv.swaps_in == kv.swaps_out
    assert llm.engine.stats().spec_draft_tokens > 0
    assert_all_returned(llm)
