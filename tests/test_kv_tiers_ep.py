"""KV cache tiers with expert parallelism on fake CPU devices: each expert shard's KV manager has its own
host tier, and its blocks go there and come back into the shard's own cache (moves indexed by shard and
block); the shards share the disk tier (one key root without a seed), so a prefix one shard wrote is a disk
hit for the other; the greedy tokens equal an expert-parallel engine's without tiers."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.cpu_test

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_llm(fixture, **overrides) -> LLM:
    # Per shard 16 usable blocks of 4 tokens: a 40-token prompt and its answer take 12, so each round's
    # prompts evict the last round's blocks of the same shard.
    return LLM(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
               num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
               precompile=False, progress=False, **{"parallel.expert": 2}, **overrides)


def rounds(llm: LLM, pairs: list[list[list[int]]]) -> list[list[int]]:
    """Two prompts at a time: the first goes to shard 0, the second to shard 1 (both idle, then the first
    is the busier)."""
    out = []
    for pair in pairs:
        outputs = llm.generate([{"prompt_token_ids": p} for p in pair], GREEDY, use_tqdm=False)
        out += [o.outputs[0].token_ids for o in outputs]
    return out


def test_each_expert_shard_has_its_own_host_tier(hf_fixture_by_name):
    fixture = hf_fixture_by_name("qwen2_moe_8x4_shared")
    rng = np.random.default_rng(3)
    a, b, c, d = [rng.integers(3, fixture.model.config.vocab_size, 40).tolist() for _ in range(4)]
    pairs = [[a, b], [c, d], [a, b]]
    want = rounds(make_llm(fixture), pairs)
    llm = make_llm(fixture, host_kv_gib=1 / 1024, prefix_hash_seed=1, async_scheduling=True)
    engine = llm.engine
    assert rounds(llm, pairs) == want
    shard_tiers = engine.kv_transfer.shard_tiers
    assert len(shard_tiers) == 2 and shard_tiers[0].host is not shard_tiers[1].host
    for shard, manager in enumerate(engine.kv_cache.managers):
        stats = manager.stats
        assert stats.host_hits > 0 and stats.host_bytes_in > 0, f"shard {shard}'s blocks were meant to come back"
        assert manager.num_free_blocks == engine.runner.num_blocks - 1
    assert engine.stats().kv_cache.host_hits == sum(m.stats.host_hits for m in engine.kv_cache.managers)
    engine.kv_transfer.poll(engine.tier_link, wait=True)
    for tiers in shard_tiers:
        tiers.host.check()


def test_expert_shards_share_the_disk_tier(hf_fixture_by_name, tmp_path):
    fixture = hf_fixture_by_name("qwen2_moe_8x4_shared")
    cfg = fixture.model.config
    block_bytes = cfg.num_layers * 2 * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    rng = np.random.default_rng(4)
    a, b = [rng.integers(3, cfg.vocab_size, 40).tolist() for _ in range(2)]
    reference = make_llm(fixture)
    want = rounds(reference, [[a, b]])
    # Unseeded shards share one key root, so their disk blocks are each other's.
    managers = reference.engine.kv_cache.managers
    assert managers[0].block_keys(a) == managers[1].block_keys(a)
    disk = dict(host_kv_gib=4 * block_bytes / (1 << 30), disk_kv_path=str(tmp_path / "kv"), disk_kv_gib=0.01,
                prefix_hash_seed=5)
    first = make_llm(fixture, **disk)
    assert [t.host.num_slots for t in first.engine.kv_transfer.shard_tiers] == [2, 2]
    assert rounds(first, [[a, b]]) == want
    first.close()  # (every cached block to disk: A's written by shard 0, B's by shard 1)
    second = make_llm(fixture, **disk)
    assert rounds(second, [[b, a]]) == want[::-1]  # each on the other shard
    for shard, manager in enumerate(second.engine.kv_cache.managers):
        assert manager.stats.disk_hits > 0, f"shard {shard} was meant to read the other shard's disk blocks"
