"""Data-parallel replicas on fake CPU devices: the distributor balances load and prefers the replica
holding a request's prefix; D=2 x T=2 and D=2 x T=1 give the single-device greedy tokens."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ParallelConfig, load_config
from jaxserve.data_parallel import DataParallelEngine, RequestDistributor
from jaxserve.engine import Engine
from jaxserve.engine_client import EngineClient
from tests.conftest import HF_FIXTURES

FIXTURE = HF_FIXTURES / "llama3_gqa4_tied"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# ---- the distributor ----
def test_distributor_balances_by_load():
    d = RequestDistributor(2, block_size=4, max_imbalance=100)
    assert [d.choose([i, i + 1], None, cost) for i, cost in enumerate([10, 10, 30, 5, 5])] == [0, 1, 0, 1, 1]
    assert d.loads == [40, 20]
    d.release(0, 40)
    assert d.choose([7], None, 1) == 0


def test_distributor_prefers_the_prefix_holder_within_the_imbalance():
    d = RequestDistributor(3, block_size=4, max_imbalance=50)
    shared = list(range(100, 112))  # three full blocks
    assert d.choose(shared + [1], None, 30) == 0
    assert d.choose(shared + [2, 3], None, 10) == 0  # replicas 1 and 2 are idle, but 0 holds the prefix
    assert d.choose(shared[:8] + [9, 9, 9, 9], None, 10) == 0  # two of the three blocks match
    assert d.choose(shared, None, 10) == 0  # load 50 -> 60, the others at 0: imbalance 60 > 50 next time
    assert d.choose(shared, None, 10) == 1  # too far ahead: balance wins
    assert d.choose(shared, None, 10) == 1  # now replica 1 holds it too, and is the lighter holder
    assert d.choose(shared + [5], "tenant-a", 10) == 2  # another cache_salt shares no prefix
    assert d.choose([1, 2, 3], None, 1) == 2  # shorter than a block: no prefix, least loaded


# ---- replicas end to end ----
def dp_llm(data: int, model: int) -> LLM:
    base = load_config(None, model=FIXTURE, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
                       num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16],
                       request_buckets=[4], precompile=False, compilation_cache_dir=None)
    return LLM(config=dataclasses.replace(base, parallel=ParallelConfig(data=data, model=model)), progress=False)


@pytest.mark.parametrize("data,model", [(2, 2), (2, 1)])
def test_replicas_give_single_device_tokens(data, model):
    if jax.device_count() < data * model:
        pytest.fail(f"needs {data * model} devices; JAX started with {jax.device_count()} (see XLA_FLAGS above)")
    llm = dp_llm(data, model)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine) and len(engine.engines) == data
    devices = [{d.id for d in e.runner.kv_caches[0].sharding.device_set} for e in engine.engines]
    assert all(len(group) == model for group in devices) and not devices[0] & devices[1]
    outputs = llm.generate([{"prompt_token_ids": p} for p in REFERENCE["prompts"]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == REFERENCE["generated"]
    assert engine.distributor.loads == [0, 0] and not engine.has_unfinished_requests()
    # Every replica served some of the three prompts; a repeated prompt goes back to its holder and hits the cache.
    assert all(e.kv_cache.usage == 0.0 for e in engine.engines)
    again = llm.generate([{"prompt_token_ids": REFERENCE["prompts"][2]}], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == REFERENCE["generated"][2] and again.num_cached_tokens >= 32
    # The engine client's stats: the replicas' counters summed.
    assert isinstance(engine, EngineClient)
    stats = engine.stats()
    assert stats.prefix_cache_hits == sum(e.kv_cache.stats.hits for e in engine.engines) >= 32
    assert stats.prefix_cache_queries == sum(e.kv_cache.stats.queries for e in engine.engines)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_abort_reaches_the_owning_replica():
    llm = dp_llm(2, 1)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in REFERENCE["prompts"]]
    engine.step()
    engine.abort_request(ids[1])
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert finished[ids[1]].outputs[0].finish_reason == "abort"
    assert finished[ids[0]].outputs[0].token_ids == REFERENCE["generated"][0]
    assert engine.distributor.loads == [0, 0]


def test_a_single_engine_refuses_data_parallel_config():
    config = dataclasses.replace(load_config(None), parallel=ParallelConfig(data=2))
    with pytest.raises(ValueError, match="one engine per replica"):
        Engine(config)
