"""The engine end to end on the embedded model: accuracy with preemption and prefix caching,
identical greedy outputs under every scheduling condition, sampling features, bad inputs."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from tests.conftest import ROOT
from tools.train_tiny import held_out_problems

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def make_llm(**overrides) -> LLM:
    return LLM(config=load_config(TINY_CONFIG), progress=False, **overrides)


# The small KV pool of the preemption tests: room for one max-length request (8 blocks) and a bit, so a
# batch of requests forces preemption. One size for all of them, so their engines share compilations.
SMALL_POOL = 12


def small_pool_llm(**overrides) -> LLM:
    """An engine with the SMALL_POOL cache. Not precompiled: its steps compile the shapes they use, far
    fewer than every bucket (precompilation is the module engine's, `llm`, and its tests')."""
    return make_llm(num_blocks=SMALL_POOL, precompile=False, **overrides)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


def problems(count: int, seed: int) -> list[tuple[int, int]]:
    held_out = held_out_problems()
    rng = np.random.default_rng(seed)
    return [held_out[i] for i in rng.choice(len(held_out), count, replace=False)]


def texts(outputs) -> list[str]:
    return [c.text for out in outputs for c in out.outputs]


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage == 0.0, "blocks still referenced after every request finished"
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks - 1


def test_accuracy_with_preemption_and_prefix_caching():
    """A pool just large enough for one max-length request, 300 requests at once: heavy preemption."""
    tiny_pool = small_pool_llm()
    cases = problems(300, seed=7)
    prompts = [f"{a}+{b}=" for a, b in cases]
    outputs = tiny_pool.generate(prompts, GREEDY, use_tqdm=False)
    accuracy = np.mean([t == str(a + b) for t, (a, b) in zip(texts(outputs), cases)])
    assert accuracy >= 0.98
    assert tiny_pool.engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert_no_leaks(tiny_pool)


def test_preemption_gives_identical_greedy_tokens(llm):
    prompts = [f"{a}+{b}=" for a, b in problems(32, seed=3)]
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    tiny_pool = small_pool_llm()
    constrained = tiny_pool.generate(prompts, GREEDY, use_tqdm=False)
    assert tiny_pool.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in constrained] == [o.outputs[0].token_ids for o in reference]
    assert_no_leaks(tiny_pool)


def test_prefix_caching_on_off_identical_with_hits(llm):
    # Shared prefixes: "<s>123" fills one block of 4 tokens.
    prompts = [f"123+{b}=" for b in range(100, 140)] + [f"45{c}+77=" for c in range(10)]
    with_cache = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.kv_cache.stats
    assert stats.hits > 0 and stats.hit_rate > 0
    assert any(o.num_cached_tokens > 0 for o in with_cache)
    no_cache = make_llm(enable_prefix_caching=False)
    without = no_cache.generate(prompts, GREEDY, use_tqdm=False)
    assert texts(with_cache) == texts(without)
    assert all(o.num_cached_tokens == 0 for o in without)
    assert texts(with_cache) == [str(123 + b) for b in range(100, 140)] + [str(450 + c + 77) for c in range(10)]


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_chunked_prefill_budgets_identical(llm, budget):
    prompts = [f"{a}+{b}=" for a, b in problems(12, seed=11)]
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    small = make_llm(max_num_batched_tokens=budget, token_buckets=[budget], request_buckets=[4, 16, 64],
                     precompile=False)
    assert texts(small.generate(prompts, GREEDY, use_tqdm=False)) == texts(reference)
    assert_no_leaks(small)


def test_steady_state_never_compiles(llm):
    """After start-up compilation, steps of any prompt length and batch size trace nothing."""
    llm.generate(["1+1="], GREEDY, use_tqdm=False)  # any one-off eager work outside the step
    cases = problems(64, seed=5)
    mixed = [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
             SamplingParams(temperature=1.0, top_k=3, logprobs=2, repetition_penalty=1.2)]
    with jax.no_tracing():
        for size in (1, 3, 17, 64):
            batch = [f"{a}+{b}=" for a, b in cases[:size]]
            llm.generate(batch, GREEDY, use_tqdm=False)
            llm.generate(batch, [mixed[i % 3] for i in range(size)], use_tqdm=False)
    assert_no_leaks(llm)


def test_start_up_runs_every_step_and_sampler_program_once(llm, monkeypatch):
    """Precompile ends by running each forward executable (both twins of a shape that has two; the
    prompt-logprob variants) and each sampler variant once, on steps into the null block (on a GPU an
    executable loads its kernels on its first run, which must not fall in the middle of serving). The
    warm-up holds no block and leaves the outputs right."""
    from jaxserve.runner import precompile
    runner = llm.engine.runner
    runs = collections.Counter()
    warm = precompile.warm

    def counted(key, program):
        def run(*args, **kwargs):
            runs[key] += 1
            return program(*args, **kwargs)
        return run

    def counting_warm(runner):
        compiled = dict(runner._compiled)
        runner._compiled.update({key: counted(key, program) for key, program in compiled.items()})
        try:
            return warm(runner)
        finally:
            runner._compiled.update(compiled)
    monkeypatch.setattr(precompile, "warm", counting_warm)
    runner.precompile(progress=False)  # (its programs are in this process's compilation cache already)
    programs = {key for key in runner._compiled if key[0] in ("forward", "forward_prompt", "sample")}
    assert any(key[0] == "forward_prompt" for key in programs) and runner.flash_prefill_threshold == 0
    assert {key: runs[key] for key in programs} == {key: 1 for key in programs}
    assert_no_leaks(llm)
    cases = problems(16, seed=11)
    outputs = llm.generate([f"{a}+{b}=" for a, b in cases], GREEDY, use_tqdm=False)
    assert np.mean([t == str(a + b) for t, (a, b) in zip(texts(outputs), cases)]) >= 0.9


def test_prompt_logprobs_steps_never_compile(llm):
    """Steps with prompt logprobs run their precompiled variant at every token bucket, mixed with plain
    requests, and plain requests give the same tokens beside them."""
    cases = problems(64, seed=9)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    scored = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    with jax.no_tracing():
        for size in (1, 5, 64):
            batch = [f"{a}+{b}=" for a, b in cases[:size]]
            mixed = llm.generate(batch, [scored if i % 2 == 0 else plain for i in range(size)], use_tqdm=False)
            assert [o.outputs[0].token_ids for o in mixed] == \
                [o.outputs[0].token_ids for o in llm.generate(batch, plain, use_tqdm=False)]
            assert all((o.prompt_logprobs is not None) == (i % 2 == 0) for i, o in enumerate(mixed))
            assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in mixed[::2])
    assert_no_leaks(llm)


def test_decode_steps_take_the_decode_only_path(llm, monkeypatch):
    """The step function gets decode_only=True exactly when every request has one token (token r
    being request r's), so the kernels may skip their prefill path; mixed and prefill steps do not."""
    runner = llm.engine.runner
    seen = []
    run_forward = runner._run_forward

    def recording_run_forward(batch, prev_tokens, prev_index, decode_only=False, **kwargs):
        qsl, seq_lens = np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens)
        num_reqs = int(np.count_nonzero(seq_lens))  # real requests have >= 1 token in the cache
        one_each = bool((qsl[1: num_reqs + 1] == np.arange(1, num_reqs + 1)).all()) and qsl[-1] == num_reqs
        seen.append((decode_only, one_each))
        return run_forward(batch, prev_tokens, prev_index, decode_only, **kwargs)

    monkeypatch.setattr(runner, "_run_forward", recording_run_forward)
    llm.generate([f"{a}+{b}=" for a, b in problems(5, seed=9)], GREEDY, use_tqdm=False)
    assert all(flag == one_each for flag, one_each in seen), seen
    assert {flag for flag, _ in seen} == {True, False}
    assert_no_leaks(llm)


def test_greedy_decode_steps_take_their_own_argmax(llm, monkeypatch):
    """An all-greedy decode step without penalties, logprobs or banned ids takes the argmax the step
    computed (no sampler launch); with logprobs or penalties every step runs the sampler. Greedy
    tokens are the same either way."""
    runner = llm.engine.runner
    calls = []
    monkeypatch.setattr(runner, "_compiled", {k: v for k, v in runner._compiled.items() if k[0] != "sample"})
    sample = runner._sample
    monkeypatch.setattr(runner, "_sample", lambda logits, md, *variant: calls.append(variant) or
                        sample(logits, md, *variant))
    prompts = [f"{a}+{b}=" for a, b in problems(6, seed=3)]
    fast = llm.generate(prompts, GREEDY, use_tqdm=False)
    fast_calls, calls[:] = len(calls), []
    with_logprobs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, logprobs=1),
                                 use_tqdm=False)
    longest = max(len(o.outputs[0].token_ids) for o in fast)
    assert fast_calls < longest <= len(calls), (fast_calls, longest, len(calls))  # decode steps skipped the sampler
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in with_logprobs]
    calls[:] = []  # penalties read the history: the sampler again (min_tokens: test_stop_strings_...)
    penalized = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens,
                                                     repetition_penalty=1.3), use_tqdm=False)
    assert max(len(o.outputs[0].token_ids) for o in penalized) <= len(calls)
    assert_no_leaks(llm)


def test_random_rows_sort_only_when_they_use_top_k_or_top_p(llm, monkeypatch):
    """The sampler's top-k / top-p sort is a variant chosen on the host: random rows without either run the
    sampler without it, and with top_p every sampling step runs it."""
    runner = llm.engine.runner
    sorts = []
    monkeypatch.setattr(runner, "_compiled", {k: v for k, v in runner._compiled.items() if k[0] != "sample"})
    sample = runner._sample
    monkeypatch.setattr(runner, "_sample", lambda logits, md, *variant: sorts.append(variant[-1]) or
                        sample(logits, md, *variant))
    prompts = [f"{a}+{b}=" for a, b in problems(4, seed=5)]
    llm.generate(prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=4), use_tqdm=False)
    assert sorts and not any(sorts)
    sorts[:] = []
    llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=4), use_tqdm=False)
    assert sorts and all(sorts)
    assert_no_leaks(llm)


def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.5, seed=1234, max_tokens=8)
    alone = llm.generate(["12+34="], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"{a}+{b}=" for a, b in problems(20, seed=1)]
    batch = others[:7] + ["12+34="] + others[7:]
    mixed = llm.generate(batch, [SamplingParams(temperature=1.0, max_tokens=8)] * 7 + [params]
                         + [SamplingParams(temperature=0.7, max_tokens=8)] * 13, use_tqdm=False)
    assert mixed[7].outputs[0].token_ids == alone
    # After a lone digit the model is unsure what comes next, so seeds matter.
    different_seed = llm.generate(["3"] * 8, [SamplingParams(temperature=1.5, seed=s, max_tokens=8)
                                              for s in range(8)], use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in different_seed}) > 1


def test_n_samples_differ_and_share_prompt_blocks(llm):
    before = llm.engine.kv_cache.stats.hits
    out = llm.generate(["5+5"], SamplingParams(n=6, temperature=1.5, seed=7, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(6))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Prompt "<s>5+5" is 4 tokens: one full block of 4... which the last-token rule keeps from
    # being a hit, so use the hits of a 5-token prompt below.
    before = llm.engine.kv_cache.stats.hits
    out = llm.generate(["5+5="], SamplingParams(n=6, temperature=1.5, seed=7, max_tokens=6), use_tqdm=False)[0]
    # Prompt "<s>5+5=" is 5 tokens: one full block of 4 that the 5 later samples hit.
    assert llm.engine.kv_cache.stats.hits - before >= 5 * 4
    assert_no_leaks(llm)


def test_stop_strings_stop_ids_min_tokens_ignore_eos(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("12+38=", SamplingParams(temperature=0, stop=["0"]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("5", "stop", "0")
    out = llm.generate("12+38=", SamplingParams(temperature=0, stop=["0"], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "50"
    stop_id = tok.token_to_id("5")
    out = llm.generate("12+38=", SamplingParams(temperature=0, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([stop_id], "stop", stop_id)
    out = llm.generate("1+2=", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    out = llm.generate("1+2=", SamplingParams(temperature=0, min_tokens=4, max_tokens=6), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 4
    assert tok.eos_token_id not in out.outputs[0].token_ids[:3]
    plain = llm.generate("1+2=", GREEDY, use_tqdm=False)[0].outputs[0]
    assert (plain.text, plain.finish_reason, plain.stop_reason) == ("3", "stop", None)
    out = llm.generate("1+2=", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("3", "length")
    assert_no_leaks(llm)


def test_logprobs(llm):
    out = llm.generate("12+34=", SamplingParams(temperature=0, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 3  # "46" and the end of sequence
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "12+34"}], SamplingParams(temperature=0))[0]
    assert out.outputs[0].text == "46"
    assert out.prompt == "<s>12+34="


def test_chat_passes_tools_and_continue_final_message_to_the_template(llm):
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}"
                "{% if tools %}+{{ tools | length }}{% endif %}={% endif %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": name, "parameters": {}}} for name in ("f", "g")]
    greedy = SamplingParams(temperature=0)
    out = llm.chat([{"role": "user", "content": "12"}], greedy, chat_template=template, tools=tools)[0]
    assert (out.prompt, out.outputs[0].text) == ("<s>12+2=", "14")
    conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "99+1"}]
    closed = llm.chat(conversation, greedy, chat_template=template + "=", add_generation_prompt=False)[0]
    assert closed.prompt == "<s>1+1=99+1="
    opened = llm.chat(conversation, greedy, chat_template=template + "=", add_generation_prompt=False,
                      continue_final_message=True)[0]
    assert opened.prompt == "<s>1+1=99+1"
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(conversation, greedy, continue_final_message=True)


def _workload():
    """Every feature whose bookkeeping the overlap touches: preemption, seeds, penalties (their token
    history forces a wait for the pending token), stop strings and ids, min/max tokens, logprobs, n."""
    prompts = [f"{a}+{b}=" for a, b in problems(16, seed=11)]
    params = [SamplingParams(temperature=0.0, max_tokens=8),
              SamplingParams(temperature=1.2, seed=5, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6),
              SamplingParams(temperature=0.0, stop=["1"], max_tokens=8),
              SamplingParams(temperature=0.0, stop_token_ids=[5, 6], max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=0.0, min_tokens=5, max_tokens=7, logprobs=2),
              SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5)]
    return prompts, [params[i % len(params)] for i in range(len(prompts))]


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _logprobs(outputs):
    return [c.cumulative_logprob or 0.0 for o in outputs for c in o.outputs]


def test_overlap_and_sync_scheduling_give_identical_outputs(llm):
    assert llm.engine.async_scheduling  # overlap is the default
    prompts, params = _workload()
    results = {}
    for async_scheduling in (True, False):
        engine = small_pool_llm(async_scheduling=async_scheduling)  # preemption
        results[async_scheduling] = engine.generate(prompts, params, use_tqdm=False)
        assert engine.engine.scheduler.num_preemptions > 0
        assert_no_leaks(engine)
    assert _summary(results[True]) == _summary(results[False])
    # (Batches differ in padding between the modes, so float sums may differ in the last bits.)
    assert _logprobs(results[True]) == pytest.approx(_logprobs(results[False]), abs=1e-4)
    assert [len(c.token_ids) for c in results[True][5].outputs] == [1]  # max_tokens=1 exact with a step in flight


def test_abort_while_a_step_is_in_flight(llm):
    engine = llm.engine
    keep = engine.add_request("12+34=", GREEDY)
    drop = engine.add_request("123+456=", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()  # dispatches the prefill; nothing is read back yet
    engine.step()  # dispatches a decode step, then reads the prefill's tokens
    engine.abort_request(drop)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[drop].outputs[0].finish_reason == "abort"
    assert (finished[keep].outputs[0].text, finished[keep].outputs[0].finish_reason) == ("46", "stop")
    assert_no_leaks(llm)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    request_id = engine.add_request("123+456=", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.abort_request(request_id)
    outputs = engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.request_id == request_id] == ["abort"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt,params,match", [
    ("1+" * 20, None, "maximum model length"),
    ({"prompt_token_ids": [1, 4, 99]}, None, "out of vocabulary"),
    ({"prompt_token_ids": []}, None, "empty"),
    ("", None, None),
    ("1+1=", SamplingParams(n=1000, temperature=1.0), "n"),
    ("1+1=", SamplingParams(logprobs=500), "logprobs"),
    ("1+1=", SamplingParams(stop_token_ids=[10_000]), "stop_token_ids"),
    ({"prompt": "1+1=", "promt_token_ids": [1, 5]}, None, r"unknown key\(s\) \['promt_token_ids'\]"),
    ({"prompt": "1+1=", "multi_modal_data": {"image": "x.png"}}, None, "multi_modal_data is not supported"),
])
def test_bad_inputs_raise_and_engine_keeps_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([ "7+8=", prompt], params, use_tqdm=False)
    # Nothing was queued, and the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    assert texts(llm.generate(["7+8="], GREEDY, use_tqdm=False)) == ["15"]


def test_max_tokens_past_the_context_stops_at_max_model_len(llm):
    """vLLM's offline behaviour: generation ends at max_model_len with finish_reason "length"; the server's
    strict preparation refuses it instead (a 400 there); a prompt that fills the context alone is refused."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [out] = llm.generate(["12+34="], params, use_tqdm=False)
    completion = out.outputs[0]
    assert len(out.prompt_token_ids) + len(completion.token_ids) == llm.engine.max_model_len == 32
    assert completion.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens=40 plus the prompt's"):
        llm.engine.prepare_request("12+34=", params, strict=True)
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate([{"prompt_token_ids": [5] * 32}], params, use_tqdm=False)
    assert_no_leaks(llm)


def test_engine_is_an_engine_client(llm):
    from jaxserve.engine_client import EngineClient

    engine = llm.engine
    assert isinstance(engine, EngineClient)
    before = engine.stats()
    llm.generate(["12+34=", "12+34="], GREEDY, use_tqdm=False)
    stats = engine.stats()
    assert stats.prefix_cache_queries > before.prefix_cache_queries
    assert stats.prefix_cache_hits == engine.kv_cache.stats.hits > before.prefix_cache_hits
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert engine.sampling_defaults == engine.model.generation.sampling
    # one owner of the tokenizer: the input processor (the output processor is handed it per request)
    assert engine.tokenizer is engine.input_processor.tokenizer and not hasattr(engine.output_processor, "tokenizer")


def test_a_plain_list_of_ints_is_a_token_id_prompt(llm):
    engine = llm.engine
    as_list = engine.prepare_request([1, 5, 14, 5, 15], GREEDY)  # "<s>1+1="
    assert as_list.prompt_token_ids == engine.prepare_request("1+1=", GREEDY).prompt_token_ids
    assert as_list.prompt is None
    request_id = engine.add_request([1, 5, 14, 5, 15], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished and o.request_id == request_id]
    assert [o.outputs[0].text for o in finished] == ["2"]
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.prepare_request([1, 99], GREEDY)
    # vLLM's prompt dicts: an empty multi-modal entry asks for nothing; the cache salt is the dict's
    vllm_style = engine.prepare_request({"prompt": "1+1=", "multi_modal_data": {}, "cache_salt": "t"}, GREEDY)
    assert vllm_style.prompt_token_ids == as_list.prompt_token_ids and vllm_style.cache_salt == "t"


def test_one_priority_applies_to_every_prompt(llm, monkeypatch):
    seen = []
    prepare = llm.engine.prepare_request

    def spy(*args, **kwargs):
        seen.append(kwargs["priority"])
        return prepare(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "prepare_request", spy)
    assert texts(llm.generate(["7+8=", "1+2="], GREEDY, use_tqdm=False, priority=3)) == ["15", "3"]
    assert seen == [3, 3]
    llm.generate(["7+8=", "1+2="], GREEDY, use_tqdm=False, priority=[1, 2])
    assert seen[2:] == [1, 2]
    with pytest.raises(ValueError, match="priority has 1 entries but there are 2 prompts"):
        llm.generate(["7+8=", "1+2="], GREEDY, use_tqdm=False, priority=[1])


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"n": 0}, "n"), ({"stop": [""]}, "stop"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_kv_cache_sizing_leaves_room_for_the_step_buffers(monkeypatch):
    """On an accelerator the cache takes memory_fraction of what is free after the buffers the runner
    makes later (staged step inputs, logits); with gpu_memory_utilization (vLLM's) what the weights and
    those buffers leave of that share of the device; the exact count when cache.num_blocks is set."""
    from jaxserve.models.llama import LlamaConfig
    from jaxserve.runner import device_setup as mr

    class Device:
        in_use = 0  # the weights

        def memory_stats(self):
            return {"bytes_limit": 1 << 30, "bytes_in_use": self.in_use}

    engine_config = load_config(ROOT / "configs" / "tiny.yaml", num_blocks=None)
    llm_cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, max_position_embeddings=64, dtype="float32")
    monkeypatch.setattr(mr.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mr.jax, "devices", lambda: [Device()])
    per_block = mr.kv_block_bytes(llm_cfg, engine_config.cache.block_size, 4)
    fraction = engine_config.cache.kv_memory_fraction
    full = mr.kv_cache_num_blocks(llm_cfg, engine_config, 32, 4)
    assert full == int((1 << 30) * fraction) // per_block
    reserved = mr.kv_cache_num_blocks(llm_cfg, engine_config, 32, 4, reserved_bytes=1 << 28)
    assert reserved == int(((1 << 30) - (1 << 28)) * fraction) // per_block
    exact = load_config(ROOT / "configs" / "tiny.yaml", num_blocks=77)
    assert mr.kv_cache_num_blocks(llm_cfg, exact, 32, 4, reserved_bytes=1 << 28) == 77
    # vLLM's gpu_memory_utilization: 0.75 of the 1 GiB for everything; 256 MiB of weights, 64 MiB reserved
    Device.in_use = 1 << 28
    vllm_style = load_config(ROOT / "configs" / "tiny.yaml", num_blocks=None, gpu_memory_utilization=0.75)
    assert mr.kv_cache_num_blocks(llm_cfg, vllm_style, 32, 4, reserved_bytes=1 << 26) == \
        (3 * (1 << 28) - (1 << 28) - (1 << 26)) // per_block
    assert mr.kv_cache_num_blocks(llm_cfg, engine_config, 32, 4, reserved_bytes=1 << 26) == \
        int(((1 << 30) - (1 << 28) - (1 << 26)) * fraction) // per_block  # jaxserve's: of the free memory
    Device.in_use = 3 * (1 << 28) - (1 << 26)  # the weights alone leave less than the step buffers need
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.75 lets the engine use 0.75 GiB of the device's "
                                         r"1.00 GiB, but 0.69 GiB are in use .* need 0.06 GiB more \(0.75 GiB\)"):
        mr.kv_cache_num_blocks(llm_cfg, vllm_style, 32, 4, reserved_bytes=1 << 26)
    Device.in_use = 0
    # an allocator without statistics (XLA's VMM allocator): the driver's figures, else a clear error
    Device.memory_stats = lambda self: None
    monkeypatch.setattr(mr, "driver_memory", lambda device: (1 << 30, 1 << 29))
    assert mr.kv_cache_num_blocks(llm_cfg, engine_config, 32, 4) == int((1 << 29) * fraction) // per_block
    monkeypatch.setattr(mr, "driver_memory", lambda device: None)
    with pytest.raises(ValueError, match="set cache.num_blocks"):
        mr.kv_cache_num_blocks(llm_cfg, engine_config, 32, 4)


def test_decode_steps_alternate_twin_executables_when_enabled():
    """On GPU (`use_twins`) decode steps alternate between two executables of the same step, so each
    keeps its own temporaries under overlap; precompile makes both and the tokens do not change."""
    config = load_config(ROOT / "configs" / "tiny.yaml")
    prompts = [f"{a}+{b}=" for a, b in problems(6, seed=11)]
    plain = LLM(config=config, progress=False).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(config=config, precompile=False, progress=False)
    runner = llm.engine.runner
    runner.use_twins = True  # what a GPU platform sets
    runner.precompile(progress=False)
    slowest = runner.slowest_compiles  # (the bench prints them: where a slow start-up goes)
    assert 0 < len(slowest) <= 5 and all(s >= 0 for _, s in slowest)
    assert [s for _, s in slowest] == sorted((s for _, s in slowest), reverse=True)
    assert {key.split()[0] for key, _ in slowest} <= {"forward", "forward_prompt", "stage", "sample", "verify"}
    calls = {}

    def counting(key, fn):
        def call(*args):
            calls[key] = calls.get(key, 0) + 1
            return fn(*args)
        return call

    for key in [k for k in runner._compiled if k[0] == "forward" and k[3]]:
        runner._compiled[key] = counting(key, runner._compiled[key])
    with jax.no_tracing():
        twins = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in twins] == [o.outputs[0].token_ids for o in plain]
    assert {key[4] for key in calls} == {False, True}, calls
    assert_no_leaks(llm)
