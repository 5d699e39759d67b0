"""Expert load counting and rebalancing in the engine (parallel.expert, core/eplb.py, runner/ep_runner.py), on
fake CPU devices:

- the on-device load accumulator equals the routed tokens: scheduled tokens x top-k per MoE layer, padding
  rows excluded; EngineStats and /metrics report it with each layer's max/mean device load.
- after a warm-up rebalance, two more rebalances and the steps around them trace nothing, and greedy tokens
  stay the E=1 engine's (transformers' reference tokens).
- parallel.rebalance_interval_steps rebalances mid-generation on an expert x model mesh, tokens unchanged.
- a skewed router (a few experts favoured): max/mean device load, measured from the accumulator, drops to
  <= 1.15 after a rebalance with redundant slots, and the greedy tokens are unchanged by the move.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.config import ParallelConfig, load_config
from jaxserve.core import eplb
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.metrics import ServerMetrics
from tests.conftest import HF_FIXTURES, HF_MOE_NAMES

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or jax.device_count() < 8,
                                reason="the expert-parallel engine tests run on 8 fake CPU devices")


def engine_config(name: str, expert: int, redundant: int = 0, model: int = 1, interval: int = 0, **overrides):
    options = dict(model=HF_FIXTURES / name, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
                   num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
                   precompile=False, compilation_cache_dir=None)
    base = load_config(None, **(options | overrides))
    return dataclasses.replace(base, parallel=ParallelConfig(expert=expert, model=model, num_redundant_experts=redundant,
                                                             rebalance_interval_steps=interval))


def prompts(name: str) -> list[dict]:
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    return [{"prompt_token_ids": p} for p in reference["prompts"]]


def greedy_tokens(llm: LLM, requests, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]


class TokenCounter:
    """A step observer summing the tokens of every dispatched step and, as the server does, reading the
    engine's stats after each processed step (with overlap the next step is in flight by then)."""

    def __init__(self, engine):
        self.engine, self.tokens, self.processed_tokens, self.loads = engine, 0, 0, []

    def on_dispatch(self, out, handle, t_start, t_scheduled):
        self.tokens += out.num_scheduled_tokens

    def on_processed(self, out, t_collect, t_collected):
        self.processed_tokens += out.num_scheduled_tokens
        self.loads.append((self.processed_tokens, np.array(self.engine.stats().expert_load)))


def test_load_accumulator_counts_routed_tokens():
    name = HF_MOE_NAMES[0]
    llm = LLM(config=engine_config(name, 2), progress=False)
    counter = TokenCounter(llm.engine)
    llm.engine.add_observer(counter)
    greedy_tokens(llm, prompts(name))
    spec = llm.engine.model.config.moe
    load = llm.engine.runner.read_expert_load()
    assert load.shape == (len(spec.sparse_layers), spec.num_experts) and counter.tokens > 0
    assert load.sum(1).tolist() == [counter.tokens * spec.top_k] * len(spec.sparse_layers)
    assert (load >= 0).all() and (load > 0).sum() > spec.top_k  # spread over experts, not one column
    # stats read mid-run (a later step in flight, its accumulator donated) give each processed step's load
    assert len(counter.loads) > 2
    for processed, stats_load in counter.loads:
        assert stats_load.sum(1).tolist() == [processed * spec.top_k] * len(spec.sparse_layers)
    # /metrics: the load up to the last processed step (a step still in flight, with no live request left,
    # counts in the accumulator only), and each layer's max/mean device load for it
    llm.engine.step()  # processes any step still in flight
    stats = llm.engine.stats()
    assert stats.expert_load == tuple(map(tuple, load.tolist()))
    ratio = eplb.max_mean_device_load(load, llm.engine.runner.host_placement)
    assert stats.expert_device_load_max_over_mean == tuple(ratio.tolist()) and (ratio >= 1).all()
    metrics = ServerMetrics("m")
    metrics.record_step(stats)
    text = metrics.render().decode()
    assert f'jaxserve:expert_load{{expert="3",layer="1",model_name="m"}} {float(load[1, 3])}' in text
    assert f'jaxserve:expert_device_load_max_over_mean{{layer="0",model_name="m"}} {ratio[0]}' in text


def test_rebalances_compile_nothing_and_keep_outputs():
    name = HF_MOE_NAMES[-1]
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    params = dataclasses.replace(GREEDY, max_tokens=len(reference["generated"][0]))
    llm = LLM(config=engine_config(name, 4, redundant=4, precompile=True), progress=False)
    requests = prompts(name)
    assert greedy_tokens(llm, requests, params) == reference["generated"]
    first = llm.engine.rebalance_experts()  # the warm-up: apply_placement's one compile
    placements = [first.phys_to_logical]
    with jax.no_tracing():
        for _ in range(2):
            assert greedy_tokens(llm, requests, params) == reference["generated"]
            placements.append(llm.engine.rebalance_experts().phys_to_logical)
        assert greedy_tokens(llm, requests, params) == reference["generated"]
    # the rebalances moved experts (the tokens above ran on other layouts than the default)
    spec = llm.engine.model.config.moe
    default = eplb.Placement.default(len(spec.sparse_layers), spec.num_experts, 4, 4).phys_to_logical
    assert any(not np.array_equal(p, default) for p in placements)


def skew_router(llm: LLM, favoured: list[int], scale: float) -> None:
    """Scales the router columns of the `favoured` experts by `scale` and the others' by 1 / scale in every
    MoE layer: a favoured expert's logit is large wherever it is positive, so it wins top-k for about half the
    tokens, far more than its share."""
    params = llm.engine.model.params
    for layer in llm.engine.model.config.moe.sparse_layers:
        router = params["layers"][layer]["router"]
        host = np.array(router) / scale
        host[:, favoured] *= scale * scale
        params["layers"][layer]["router"] = jax.device_put(host, router.sharding)


def test_skewed_load_is_balanced_after_rebalance():
    name = HF_MOE_NAMES[0]
    # (no prefix caching: both runs compute every prompt token, so they route the same tokens)
    llm = LLM(config=engine_config(name, 4, redundant=8, enable_prefix_caching=False), progress=False)
    skew_router(llm, [0, 1], 8.0)
    requests = prompts(name)
    before_tokens = greedy_tokens(llm, requests)
    runner = llm.engine.runner
    load = runner.read_expert_load()
    before = eplb.max_mean_device_load(load, runner.host_placement)
    assert before.max() > 1.3  # the favoured experts share a device in the default placement
    llm.engine.rebalance_experts()
    after_tokens = greedy_tokens(llm, requests)
    after = eplb.max_mean_device_load(runner.read_expert_load(), runner.host_placement)
    assert after.max() <= 1.15, (before, after)
    assert after_tokens == before_tokens


def test_interval_rebalances_with_experts_split_over_model():
    """parallel.rebalance_interval_steps on an expert x model mesh (each expert's F split over "model", which
    the weight move keeps): the engine rebalances every few steps mid-generation and the greedy tokens stay
    the reference's."""
    name = HF_MOE_NAMES[0]
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    llm = LLM(config=engine_config(name, 2, redundant=2, model=2, interval=3), progress=False)
    runner = llm.engine.runner
    shardings = [runner.model.params["layers"][layer]["we_gate_up"].sharding
                 for layer in llm.engine.model.config.moe.sparse_layers]
    params = dataclasses.replace(GREEDY, max_tokens=len(reference["generated"][0]))
    assert greedy_tokens(llm, prompts(name), params) == reference["generated"]
    spec = llm.engine.model.config.moe
    default = eplb.Placement.default(len(spec.sparse_layers), spec.num_experts, 2, 2)
    assert not np.array_equal(runner.host_placement.phys_to_logical, default.phys_to_logical)
    assert [runner.model.params["layers"][layer]["we_gate_up"].sharding
            for layer in llm.engine.model.config.moe.sparse_layers] == shardings
    with pytest.raises(ValueError, match="parallel.rebalance_interval_steps must be an integer >= 0"):
        ParallelConfig(rebalance_interval_steps=-1)
