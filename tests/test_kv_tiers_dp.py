"""KV cache tiers with data-parallel replicas on fake CPU devices: each replica has its own host tier of
cache.host_kv_gib, the disk directory is shared, so blocks one replica wrote are disk hits for another
(their keys agree without a configured seed); the greedy tokens are transformers'."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ParallelConfig, load_config
from jaxserve.data_parallel import DataParallelEngine
from tests.conftest import HF_FIXTURES

pytestmark = pytest.mark.cpu_test

FIXTURE = HF_FIXTURES / "llama3_gqa4_tied"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK_GIB = 1024 / (1 << 30)  # one block of the fixture: 2 layers x K,V x 4 slots x 2 heads x 8 x f32


def run(engine, prompts: list[list[int]]) -> list[list[int]]:
    """One replica (an Engine) alone until its requests finish."""
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
    return [done[i] for i in ids]


def test_replicas_have_their_own_host_tier_and_share_the_disk(tmp_path):
    if jax.device_count() < 2:
        pytest.fail(f"needs 2 devices; JAX started with {jax.device_count()}")
    base = load_config(None, model=FIXTURE, dtype="float32", skip_tokenizer_init=True, max_model_len=48, block_size=4,
                       num_blocks=14, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16],
                       request_buckets=[4], precompile=False, compilation_cache_dir=None, host_kv_gib=3 * BLOCK_GIB,
                       disk_kv_path=str(tmp_path / "kv"), disk_kv_gib=0.01)
    assert base.cache.prefix_hash_seed is None
    llm = LLM(config=dataclasses.replace(base, parallel=ParallelConfig(data=2)), progress=False)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine)
    first, second = engine.engines
    hosts = [replica.kv_transfer.tiers.host for replica in engine.engines]
    assert hosts[0] is not hosts[1]
    assert [(h.num_slots, h.block_bytes) for h in hosts] == [(3, 1024)] * 2  # host_kv_gib each
    prompts, want = REFERENCE["prompts"], [g[:GREEDY.max_tokens] for g in REFERENCE["generated"]]
    # Replica 0 serves every prompt; its small pools push the blocks down to the disk.
    assert run(first, prompts) == want
    first.kv_transfer.poll(first.kv_cache.tier_link, wait=True)
    assert first.kv_cache.stats.disk_bytes_in > 0
    # Replica 1 never saw them: its prefixes come from replica 0's disk blocks.
    assert run(second, prompts) == want
    kv = second.kv_cache.stats
    assert kv.disk_hits > 0 and kv.disk_bytes_out > 0
    # Through the facade: tokens, and the replicas' tier counters summed.
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == want
    stats = engine.stats()
    assert stats.kv_cache.disk_hits == sum(e.kv_cache.stats.disk_hits for e in engine.engines)
    assert dict(stats.kv_tier_usage).keys() == {"device", "host", "disk"}
    for replica in engine.engines:
        assert replica.kv_cache.num_free_blocks == replica.runner.num_blocks - 1
        replica.kv_transfer.poll(replica.kv_cache.tier_link, wait=True)
        replica.kv_transfer.tiers.host.check()
    llm.engine.close()
