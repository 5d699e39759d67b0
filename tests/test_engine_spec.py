"""N-gram speculative decoding end to end: greedy outputs are token-identical to decoding without it on
the embedded model and on an HF fixture, with overlap on and off, under preemption and prefix caching,
alongside seeded random sampling, penalties, logprobs, stops and n > 1 (same tokens too), and with
nothing compiled after start-up. Random sampling's own tests: tests/test_spec_sampling.py."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.test_engine import _summary, _workload, assert_no_leaks, make_llm, problems

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
# "a+0=" style prompts: the answer repeats the prompt's digits, so guesses are often right.
PROMPTS = ["4567+0=", "1234+1=", "3000+12=", "5050+5050=", "8888+1=", "1001+1000=", "7070+7=", "2222+2222="] + [
    f"{a}+{b}=" for a, b in problems(24, seed=13)]


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(precompile=False)
    return {"greedy": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
            "workload": llm.generate(*_workload(), use_tqdm=False)}


def token_ids(outputs):
    return [c.token_ids for out in outputs for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_greedy_tokens_identical_with_preemption_and_prefix_caching(reference, async_scheduling):
    llm = make_llm(precompile=False, num_blocks=12, async_scheduling=async_scheduling, speculative_config=SPEC)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference["greedy"])
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted_tokens > 0 and scheduler.num_preemptions > 0
    # Under overlap greedy rows verify guesses right behind their verify step: n-grams proposed on device
    # from that step's tokens, its position moved on device.
    assert (scheduler.num_device_guessed > 0) == async_scheduling
    stats = llm.engine.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (scheduler.num_draft_tokens,
                                                                     scheduler.num_accepted_tokens)
    assert llm.engine.kv_cache.stats.hits > 0
    assert_no_leaks(llm)
    # Seeded sampling, penalties, logprobs, n > 1 (the same tokens as without guesses), stops inside accepted runs.
    assert _summary(llm.generate(*_workload(), use_tqdm=False)) == _summary(reference["workload"])
    assert_no_leaks(llm)


def test_logprobs_of_accepted_guesses(reference):
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    plain = make_llm(precompile=False).generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(precompile=False, speculative_config=SPEC)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert token_ids(outputs) == token_ids(plain)
    for ours, theirs in zip(outputs, plain):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert len(ours.logprobs) == len(ours.token_ids)
        for entry, expected in zip(ours.logprobs, theirs.logprobs):
            assert list(entry) == list(expected)  # the token, then the top 2, in order
            assert [e.logprob for e in entry.values()] == pytest.approx([e.logprob for e in expected.values()],
                                                                        abs=1e-4)
            assert [e.rank for e in entry.values()] == [e.rank for e in expected.values()]
        assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)


def test_no_compiles_after_start_up_with_guesses():
    llm = make_llm(speculative_config=SPEC)
    llm.generate(["1+1="], GREEDY, use_tqdm=False)
    with jax.no_tracing():
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.generate(*_workload(), use_tqdm=False)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_hf_fixture_greedy_tokens_with_guesses(hf_fixture_by_name):
    fixture = hf_fixture_by_name("llama3_gqa4_tied")
    llm = LLM(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
              precompile=False, progress=False, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in fixture.prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [list(g) for g in fixture.generated]
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert llm.engine.kv_cache.usage == 0.0


def test_verify_steps_alternate_twin_executables_when_enabled(reference):
    """On GPU (`use_twins`) the verify steps of a shape alternate between two executables, as decode steps
    do, so back-to-back verify steps keep their temporaries apart under overlap; the tokens do not change."""
    llm = make_llm(precompile=False, speculative_config=SPEC)
    runner = llm.engine.runner
    runner.use_twins = True  # what a GPU platform sets
    calls: dict[tuple, int] = {}
    forward_fn = runner.forward_fn

    def counting(*args, decode_only=False, twin=False, **kwargs):
        calls[(decode_only, twin)] = calls.get((decode_only, twin), 0) + 1
        return forward_fn(*args, decode_only=decode_only, twin=twin, **kwargs)

    runner.forward_fn = counting
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference["greedy"])
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert calls.get((False, True), 0) > 0 and calls.get((False, False), 0) > 0, calls  # verify steps, both twins
    assert_no_leaks(llm)
