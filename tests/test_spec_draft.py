"""Draft-model speculative decoding end to end: greedy outputs are token-identical to decoding without it
(the embedded model, with overlap on and off, under preemption and prefix caching, beside requests that do
not guess; HF fixtures with a draft of the same vocabulary), a draft identical to the target has its
guesses accepted, the trained embedded draft has some accepted, bad configs are refused at start, and
nothing compiles after start-up."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import HF_FIXTURES, TINY_MODEL
from tests.test_engine import _summary, _workload, assert_no_leaks, make_llm, problems

TINY_DRAFT = TINY_MODEL.parent / "tiny-adder-draft"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = ["4567+0=", "1234+1=", "3000+12=", "5050+5050=", "8888+1=", "1001+1000=", "7070+7=", "2222+2222="] + [
    f"{a}+{b}=" for a, b in problems(24, seed=13)]


def spec(model=TINY_DRAFT, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def token_ids(outputs):
    return [c.token_ids for out in outputs for c in out.outputs]


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(precompile=False)
    return {"greedy": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
            "workload": llm.generate(*_workload(), use_tqdm=False)}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_target_as_its_own_draft_is_accepted_with_preemption_and_prefix_caching(reference, async_scheduling):
    llm = make_llm(precompile=False, num_blocks=10, async_scheduling=async_scheduling,
                   speculative_config=spec(TINY_MODEL))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference["greedy"])
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and llm.engine.kv_cache.stats.hits > 0
    # The same network guesses: every guess is the target's own greedy token.
    assert scheduler.num_draft_tokens > 0
    assert scheduler.num_accepted_tokens >= 0.95 * scheduler.num_draft_tokens
    assert_no_leaks(llm)
    # Requests that do not guess (sampling, penalties, logprobs, n > 1) and stops inside accepted runs.
    assert _summary(llm.generate(*_workload(), use_tqdm=False)) == _summary(reference["workload"])
    assert_no_leaks(llm)


def test_trained_draft_has_guesses_accepted(reference):
    llm = make_llm(precompile=False, num_blocks=10, speculative_config=spec(TINY_DRAFT, k=3))
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference["greedy"])
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.num_accepted_tokens <= scheduler.num_draft_tokens
    stats = llm.engine.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (scheduler.num_draft_tokens,
                                                                     scheduler.num_accepted_tokens)
    assert_no_leaks(llm)


@pytest.mark.parametrize("draft", ["llama3_gqa4_tied", "qwen3_gqa1_untied"], ids=["itself", "another_family"])
def test_hf_fixture_greedy_tokens_with_a_draft_of_its_vocabulary(hf_fixture_by_name, draft):
    fixture = hf_fixture_by_name("llama3_gqa4_tied")
    llm = LLM(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
              precompile=False, progress=False, speculative_config=spec(HF_FIXTURES / draft, k=3))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in fixture.prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [list(g) for g in fixture.generated]
    scheduler = llm.engine.scheduler
    assert scheduler.num_draft_tokens > 0
    if draft == "llama3_gqa4_tied":
        assert scheduler.num_accepted_tokens >= 0.95 * scheduler.num_draft_tokens
    assert llm.engine.kv_cache.usage == 0.0


def test_bad_draft_configs_are_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"vocabulary of 256 tokens but the target model's has 16"):
        make_llm(precompile=False, speculative_config=spec(HF_FIXTURES / "llama3_gqa4_tied"))
    with pytest.raises(ValueError, match=r"speculative.model: .*missing.* is not a directory"):
        make_llm(precompile=False, speculative_config=spec(tmp_path / "missing"))
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        make_llm(precompile=False, speculative_config=spec(k=0))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        make_llm(precompile=False, speculative_config={**spec(), "draft_tensor_parallel_size": 2})


def test_no_compiles_after_start_up_with_drafts():
    llm = make_llm(speculative_config=spec(TINY_DRAFT, k=2), max_num_seqs=16, max_num_batched_tokens=64,
                   token_buckets=[16, 64], request_buckets=[4, 16])
    llm.generate(["1+1="], GREEDY, use_tqdm=False)
    with jax.no_tracing():
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.generate(*_workload(), use_tqdm=False)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert_no_leaks(llm)
