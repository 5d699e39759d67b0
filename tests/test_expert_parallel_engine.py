"""Expert parallelism in the engine (parallel.expert; runner/ep_runner.py, core/sharded_scheduler.py), on
fake CPU devices:

- greedy tokens of every MoE fixture with E = 2, 4, 8 expert shards and E=2 x model=2, through both dispatch
  paths (all-gather and the ragged all-to-all emulator), equal transformers' tokens, which the E=1 engine
  gives (test_engine_parity); every shard's KV blocks come back.
- after precompile, steps (greedy, and sampling with logprobs) trace nothing.
- the ShardedScheduler alone (no JAX): requests go to the least-loaded shard, rows and blocks are per
  shard, the runner's tokens split back shard by shard, aborts and finishes reach the owning shard.
- refused at start: more expert shards than devices, a dense model, one_shot all-reduce; refused per
  request: prompt_logprobs.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from jaxserve import LLM
from jaxserve.config import ParallelConfig, SchedulerConfig, load_config
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_types import RunnerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sharded_scheduler import ShardedScheduler
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from tests.conftest import HF_FIXTURES, HF_MOE_NAMES

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def engine_config(name: str, expert: int, model: int = 1, dispatch: str = "auto", **overrides):
    options = dict(model=HF_FIXTURES / name, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
                   num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
                   precompile=False, compilation_cache_dir=None)
    base = load_config(None, **(options | overrides))
    return dataclasses.replace(base, parallel=ParallelConfig(model=model, expert=expert, expert_dispatch=dispatch))


# (fixture, expert, model, dispatch): every mesh (E = 2, 4, 8 and 2 x model 2) and both dispatch paths appear
# on two fixtures each; every fixture runs both paths. (E = 1 is the plain engine of test_engine_parity.)
MIXTRAL, QWEN2_MOE, QWEN3_MOE = "mixtral_8x2_untied", "qwen2_moe_8x4_shared", "qwen3_moe_8x2_sparse2"
ROWS = [(MIXTRAL, 2, 1, "allgather"), (MIXTRAL, 4, 1, "all_to_all"), (MIXTRAL, 8, 1, "auto"),
        (QWEN2_MOE, 4, 1, "allgather"), (QWEN2_MOE, 2, 2, "all_to_all"), (QWEN2_MOE, 8, 1, "all_to_all"),
        (QWEN3_MOE, 2, 2, "allgather"), (QWEN3_MOE, 2, 1, "all_to_all")]
assert {name for name, *_ in ROWS} == set(HF_MOE_NAMES)
# test_precompiled_steps_never_trace's engine: its row is precompiled too, so the two compile once.
PRECOMPILED = (QWEN3_MOE, 2, 1, "all_to_all")
assert PRECOMPILED in ROWS


@pytest.fixture
def fake_devices():
    if jax.default_backend() != "cpu" or jax.device_count() < 8:
        pytest.skip("the expert-parallel engine tests run on 8 fake CPU devices")


@pytest.mark.usefixtures("fake_devices")
@pytest.mark.parametrize("name,expert,model,dispatch", ROWS,
                         ids=[f"{n}-e{e}xm{m}-{d}" for n, e, m, d in ROWS])
def test_greedy_tokens_equal_hf(name, expert, model, dispatch):
    precompile = (name, expert, model, dispatch) == PRECOMPILED
    llm = LLM(config=engine_config(name, expert, model, dispatch, precompile=precompile), progress=False)
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    requests = [{"prompt_token_ids": p} for p in reference["prompts"]]
    outputs = llm.generate(requests, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference["generated"]
    scheduler = llm.engine.scheduler
    assert len(scheduler.shards) == expert and llm.engine.runner.kv_caches[0].shape[0] == expert
    assert llm.engine.kv_cache.usage == 0.0 and scheduler.loads == [0] * expert


@pytest.mark.usefixtures("fake_devices")
def test_refused_at_start():
    name = HF_MOE_NAMES[0]
    with pytest.raises(ValueError, match=r"parallel.expert=16 x parallel.model=1 needs 16 devices but only 8"):
        LLM(config=engine_config(name, 16), progress=False)
    with pytest.raises(ValueError, match=r"parallel.expert=2 shards the experts of MoE layers, but "
                                         r"LlamaForCausalLM has none; set parallel.expert to 1"):
        LLM(config=engine_config("llama3_gqa4_tied", 2), progress=False)
    with pytest.raises(ValueError, match="parallel.all_reduce=one_shot is not supported with parallel.expert > 1"):
        ParallelConfig(expert=2, all_reduce="one_shot")


# ---- the sharded scheduler alone ----
def sharded_scheduler(shards: int, max_num_seqs: int = 2) -> ShardedScheduler:
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=max_num_seqs)
    return ShardedScheduler([Scheduler(config, KVCacheManager(64, 4), 64, first_row=shard * max_num_seqs)
                             for shard in range(shards)])


def request(request_id: str, prompt_len: int, max_tokens: int = 4, **params) -> Request:
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(0,))


def test_requests_go_to_the_least_loaded_shard_and_tokens_split_back():
    scheduler = sharded_scheduler(3)
    for request_id, length in [("a", 20), ("b", 4), ("c", 4), ("d", 4), ("e", 8)]:
        scheduler.add_request(request(request_id, length))
    # prompt + max_tokens: a (24) -> 0, b (8) -> 1, c (8) -> 2, d (8) -> 1 (the lowest of the 8s), e (12) -> 2
    assert [scheduler.shard_of(r) for r in "abcde"] == [0, 1, 2, 1, 2]
    assert scheduler.loads == [24, 16, 20]
    out = scheduler.schedule()
    rows = {item.request_id: item.row for item in out.scheduled}
    assert rows == {"a": 0, "b": 2, "d": 3, "c": 4, "e": 5}  # shard s owns rows 2s and 2s + 1
    assert [[item.request_id for item in shard.scheduled] for shard in out.shards] == [["a"], ["b", "d"], ["c", "e"]]
    # the runner answers shard after shard; a token of 0 (eos) finishes b
    updates = scheduler.update_from_output(out, RunnerOutput(["a", "b", "d", "c", "e"], [7, 0, 7, 7, 7]))
    assert [r.request_id for r in updates.requests] == ["a", "b", "d", "c", "e"] and updates.tokens == [7, 0, 7, 7, 7]
    assert updates.finished == {"b": (RequestStatus.FINISHED_STOPPED, None)}
    assert scheduler.loads == [24, 8, 20] and scheduler.shard_of("b") is None
    scheduler.abort_requests(["e", "unknown"])
    assert scheduler.loads == [24, 8, 8] and "e" not in scheduler.shards[2].requests
    assert len(scheduler.running) == 3 and scheduler.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampled 3 requests over 3 shards but the runner returned 1 tokens"):
        scheduler.update_from_output(scheduler.schedule(), RunnerOutput(["a"], [7]))


def test_prompt_logprobs_are_refused_per_request():
    scheduler = sharded_scheduler(2)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with parallel.expert > 1 yet"):
        scheduler.add_request(request("a", 4, prompt_logprobs=1))
    assert not scheduler.has_unfinished_requests() and scheduler.loads == [0, 0]


@pytest.mark.usefixtures("fake_devices")
def test_precompiled_steps_never_trace():
    """After precompile, expert-parallel steps (staged shard-major batches, the forward, the sampler with
    logprobs) run the compiled executables only; the sampled tokens come back replicated for the next stage."""
    name, expert, model, dispatch = PRECOMPILED
    llm = LLM(config=engine_config(name, expert, model, dispatch, precompile=True), progress=False)
    # the start-up warm-up ran every step program, and its tokens are not counted as routed load
    assert llm.engine.runner.read_expert_load().sum() == 0
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    requests = [{"prompt_token_ids": p} for p in reference["prompts"]]
    with jax.no_tracing():
        outputs = llm.generate(requests, GREEDY, use_tqdm=False)
        sampled = llm.generate(requests, SamplingParams(temperature=0.8, max_tokens=4, logprobs=2, seed=1),
                               use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference["generated"]
    assert all(len(o.outputs[0].logprobs) == 4 and len(o.outputs[0].logprobs[0]) >= 2 for o in sampled)
