"""Prompt logprobs (SamplingParams.prompt_logprobs) through the engine: every prompt position against
transformers' logits under chunked prefill and prefix caching, identical under preemption, vLLM's entry
format (the prompt token first, with its rank, then the top-N), -1 for the whole vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from tests.conftest import ROOT, HFFixture

TIED_AND_UNTIED = ["llama3_gqa4_tied", "llama2_mha_untied"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), -1, keepdims=True))


def tiny(**overrides) -> LLM:
    return LLM(config=load_config(ROOT / "configs" / "tiny.yaml"), progress=False, precompile=False, **overrides)


def entries(outputs) -> list:
    return [[None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in o.prompt_logprobs]
            for o in outputs]


def assert_close(got, expected, atol=1e-5):
    for got_prompt, expected_prompt in zip(got, expected, strict=True):
        for a, b in zip(got_prompt, expected_prompt, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert list(a) == list(b) and [r for _, r in a.values()] == [r for _, r in b.values()]
                np.testing.assert_allclose([lp for lp, _ in a.values()], [lp for lp, _ in b.values()], atol=atol)


def assert_matches_hf(fixture: HFFixture, outputs) -> None:
    """Every prompt entry (top-3) against transformers' logits, and the greedy tokens."""
    for i, out in enumerate(outputs):
        prompt, reference = fixture.prompts[i], log_softmax(fixture.logits[i])
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            token, scores = prompt[position], reference[position - 1]  # logits at p - 1 score token p
            entry = out.prompt_logprobs[position]
            assert next(iter(entry)) == token  # the prompt token first, as vLLM
            assert entry[token].rank == 1 + int(np.sum(scores > scores[token]))
            np.testing.assert_allclose(entry[token].logprob, scores[token], atol=2e-5)
            top = {t: lp for t, lp in entry.items() if lp.rank <= 3}
            assert sorted(top) == sorted(np.argsort(-scores)[:3].tolist())
            np.testing.assert_allclose([top[t].logprob for t in top], [scores[t] for t in top], atol=2e-5)
            assert len(entry) in (3, 4)  # the top-3, plus the prompt token when it is not among them
        assert out.outputs[0].token_ids == fixture.generated[i][:len(out.outputs[0].token_ids)]


@pytest.mark.parametrize("name", TIED_AND_UNTIED)
def test_prompt_logprobs_match_hf_with_chunked_prefill_and_prefix_caching(name):
    """A 16-token budget spreads the 33-token prompt over three steps; the same prompts again hit the
    prefix cache for a request without prompt logprobs but not for one with them."""
    fixture = HFFixture(name)
    llm = LLM(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
              precompile=False, progress=False)
    prompts = [{"prompt_token_ids": p} for p in fixture.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(fixture, first)

    again = llm.generate(prompts, params, use_tqdm=False)
    assert all(out.num_cached_tokens == 0 for out in again)  # every position computed again
    assert_close(entries(again), entries(first))
    plain = llm.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None  # their blocks were cached all the same
    assert llm.engine.kv_cache.usage == 0.0


def test_prompt_positions_scored_per_step_are_capped(monkeypatch):
    """With at most 5 scored prompt positions per step, the scheduler shortens the chunks of requests that
    ask for prompt logprobs (plain requests fill the step beside them); the variant's arrays have 5 rows
    at every token bucket; the entries still match transformers', and the precompiled steps never compile."""
    import jax

    from jaxserve.runner import model_runner

    monkeypatch.setattr(model_runner, "MAX_PROMPT_LOGPROB_ROWS", 5)
    fixture = HFFixture("llama3_gqa4_tied")
    llm = LLM(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_seqs=4,
              token_buckets=[8, 16], request_buckets=[4], progress=False)
    runner = llm.engine.runner
    prompt_steps = []
    prepare = runner.prepare

    def recording(out):
        step = prepare(out)
        if step.prompt is not None:
            prompt_steps.append((len(step.batch.token_ids), len(step.prompt.indices),
                                 sum(segment[-1] for segment in step.prompt.segments)))
        return step

    monkeypatch.setattr(runner, "prepare", recording)
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in fixture.prompts]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    with jax.no_tracing():  # the plain request first: its 8-token chunks share steps with the scored ones
        outputs = llm.generate(prompts[:1] + prompts, [plain] + [scored] * len(prompts), use_tqdm=False)
    assert_matches_hf(fixture, outputs[1:])
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert {t_pad for t_pad, _, _ in prompt_steps} == {8, 16}
    assert all(rows == 5 and 0 < scored_rows <= 5 for _, rows, scored_rows in prompt_steps), prompt_steps
    assert len(prompt_steps) >= sum(len(p) - 1 for p in fixture.prompts) / 5
    assert llm.engine.kv_cache.usage == 0.0


def test_kv_cache_sizing_reserves_the_prompt_logprob_outputs(monkeypatch):
    """The memory reserved before the KV cache is sized holds the variant's [L, K] outputs (twice: the
    overlap keeps a step's until the next has run), L = min(T, 512) rows at the largest token bucket."""
    from jaxserve.runner import model_runner

    reserved = []
    sizing = model_runner.kv_cache_num_blocks
    monkeypatch.setattr(model_runner, "kv_cache_num_blocks",
                        lambda *args, **kwargs: reserved.append(args[-1]) or sizing(*args, **kwargs))
    vocab = tiny(max_logprobs=-1).engine.vocab_size  # K = V = 16; token buckets up to 256
    tiny(max_logprobs=0)  # K = 0
    assert reserved[0] - reserved[1] == 2 * min(256, 512) * 8 * vocab


def test_prompt_logprobs_identical_under_preemption_and_overlap():
    """A pool too small for the batch preempts requests mid-prompt and mid-output (they recompute their
    prompt): every entry arrives exactly once, equal to an unconstrained run's; with and without overlap."""
    prompts = [f"{a}+{b}=" for a, b in [(12, 34), (123, 456), (5, 7), (999, 1), (42, 58), (310, 77), (8, 80)] * 3]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    params = [params[i % 3 == 2] for i in range(len(prompts))]
    reference = tiny().generate(prompts, params, use_tqdm=False)
    for async_scheduling in (True, False):
        small = tiny(num_blocks=10, max_num_batched_tokens=8, token_buckets=[8], max_num_seqs=8, request_buckets=[4, 8],
                     async_scheduling=async_scheduling)
        constrained = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
        for got, expected, p in zip(constrained, reference, params):
            assert got.outputs[0].token_ids == expected.outputs[0].token_ids
            assert (got.prompt_logprobs is None) == (p.prompt_logprobs is None)
        with_logprobs = [i for i, p in enumerate(params) if p.prompt_logprobs is not None]
        assert_close(entries([constrained[i] for i in with_logprobs]), entries([reference[i] for i in with_logprobs]),
                     atol=1e-4)
        assert small.engine.kv_cache.usage == 0.0


def test_prompt_logprobs_zero_and_whole_vocabulary():
    llm = tiny(max_logprobs=-1)
    vocab = llm.engine.vocab_size
    zero, whole = llm.generate(["12+34=", "12+34="], [SamplingParams(temperature=0.0, prompt_logprobs=0),
                                                      SamplingParams(temperature=0.0, prompt_logprobs=-1, logprobs=-1)],
                               use_tqdm=False)
    prompt = zero.prompt_token_ids
    assert zero.prompt_logprobs[0] is None and whole.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        token = prompt[position]
        only = zero.prompt_logprobs[position]
        assert list(only) == [token] and only[token].decoded_token == llm.get_tokenizer().decode([token])
        full = whole.prompt_logprobs[position]
        assert len(full) == vocab and sorted(lp.rank for t, lp in full.items() if t != token) == \
            [r for r in range(1, vocab + 1) if r != full[token].rank]
        assert full[token].logprob == pytest.approx(only[token].logprob, abs=1e-5)
        assert np.exp([lp.logprob for lp in full.values()]).sum() == pytest.approx(1.0, abs=1e-4)
    assert all(len(entry) == vocab for entry in whole.outputs[0].logprobs)
    capped = tiny(max_logprobs=4)
    for field in ("prompt_logprobs", "logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most 4, got -1 \\(the whole vocabulary"):
            capped.generate("1+1=", SamplingParams(**{field: -1}), use_tqdm=False)


def test_rows_of_a_step_and_stale_chunks():
    """gather(): each chunk's positions that score a prompt token (not the prompt's last one, not output
    tokens); chunks(): a segment whose row was reset since the dispatch is dropped (it recomputes)."""
    from jaxserve.core.sched_types import NewRequestData, ScheduledRequest
    from jaxserve.runner import prompt_logprobs as pl

    token_buf = np.arange(40, dtype=np.int32).reshape(2, 20) + 100
    num_prompt, wants, generation = np.array([6, 10]), np.array([True, True]), np.array([3, 5])
    items = [ScheduledRequest("a", 0, 4, 4, []),  # positions 4..7 of a 6-token prompt: only 4 scores (token 5)
             ScheduledRequest("b", 1, 0, 3, [])]  # positions 0..2: score tokens 1..3
    rows = pl.gather(items, np.array([2, 6]), wants, token_buf, num_prompt, generation, rows=pl.num_rows(16, 512))
    assert rows.indices[:4].tolist() == [2, 6, 7, 8] and rows.targets[:4].tolist() == [105, 121, 122, 123]
    assert len(rows.indices) == 16 and rows.segments == [("a", 0, 3, 0, 5, 1), ("b", 1, 5, 1, 1, 3)]
    assert pl.gather(items[:1], np.array([0]), np.array([False, True]), token_buf, num_prompt, generation, 16) is None
    with pytest.raises(RuntimeError, match="scores 4 prompt positions, more than its 3 prompt-logprob rows"):
        pl.gather(items, np.array([2, 6]), wants, token_buf, num_prompt, generation, rows=pl.num_rows(16, 3))

    data = [NewRequestData(token_buf[r].tolist(), int(num_prompt[r]), SamplingParams(prompt_logprobs=1), 0, (), 4)
            for r in range(2)]
    arrays = (np.arange(16, dtype=np.float32), np.arange(16), np.zeros((16, 2), np.int32), np.zeros((16, 2)))
    kept = pl.chunks(rows.segments, arrays, np.array([3, 6]), data, vocab_size=16)  # row 1 was reset
    assert [(c.request_id, c.start, c.token_ids, c.logprobs) for c in kept] == [("a", 5, [105], [0.0])]
    assert kept[0].top_token_ids == [[0]]  # the request's own N
