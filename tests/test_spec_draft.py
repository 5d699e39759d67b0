"""Draft-model and EAGLE speculative decoding end to end: greedy outputs are token-identical to decoding
without it (the embedded model, with overlap on and off, under preemption and prefix caching, beside
requests that do not guess; tensor parallelism; HF fixtures with a draft of the same vocabulary or a random
EAGLE head), a draft identical to the target has its guesses accepted, the trained embedded draft and EAGLE
head have some accepted, bad configs are refused at start, and nothing compiles after start-up. The
scheduler's side alone runs against the scheduler harness's fake runner with a fake draft (its lookahead
K/V writes checked against every read), also in test_scheduler_machine's state machine."""

from __future__ import annotations

import collections
import functools
import json

import jax
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from jaxserve import LLM, SamplingParams
from jaxserve.config import SpeculativeConfig
from jaxserve.models import llama, quant, registry
from jaxserve.models import eagle_head as eagle
from tests.conftest import HF_FIXTURES, TINY_MODEL
from tests.scheduler_harness import Driver, FakeRunner, make_request, make_scheduler
from tests.test_engine import _summary, _workload, assert_no_leaks, make_llm, problems
from tests.test_scheduler_machine import SchedulerMachine, configs
from tests.test_scheduler_spec import OverlapDriver, cyclic, prompt

TINY_DRAFT = TINY_MODEL.parent / "tiny-adder-draft"
TINY_EAGLE = TINY_MODEL.parent / "tiny-adder-eagle"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = ["4567+0=", "1234+1=", "3000+12=", "5050+5050=", "8888+1=", "1001+1000=", "7070+7=", "2222+2222="] + [
    f"{a}+{b}=" for a, b in problems(24, seed=13)]


def spec(model=TINY_DRAFT, k: int = 3, method: str = "draft_model") -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": k}


def eagle_spec(model=TINY_EAGLE, k: int = 3) -> dict:
    return spec(model, k, "eagle")


# One token and one request bucket (the engines of test_no_compiles_after_start_up): an engine whose test
# does not depend on its batch shapes compiles each of its programs once.
ONE_BUCKET = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=[16], request_buckets=[4])
DRAFT = SpeculativeConfig(method="draft_model", model=str(TINY_DRAFT), num_speculative_tokens=3)


def token_ids(outputs):
    return [c.token_ids for out in outputs for c in out.outputs]


class DraftingRunner(FakeRunner):
    """The scheduler harness's fake runner plus a draft model's part of each step: k guesses per sampled row
    from its new token (the `cyclic` model, wrong at every 5th position so that some are rejected), and the
    K/V slots they write: the new token's position on, within the row's blocks (past them: the null block),
    each left holding what no request may read as context (the harness checks every read)."""

    def __init__(self, scheduler, token_fn=cyclic, k: int = 3):
        super().__init__(scheduler, token_fn)
        self.k = k

    def execute(self, out, tokens=None):
        result = super().execute(out, tokens)
        drafts = []
        for request_id in result.request_ids:
            state = self.states[request_id]
            sequence, capacity = list(state.token_ids), len(state.block_ids) * self.block_size
            for position in range(len(sequence) - 1, len(sequence) - 1 + self.k):
                if position < capacity:
                    self.slots[self._slot(state, position)] = ("draft", request_id, position)
                sequence.append(cyclic(request_id, sequence) + (len(sequence) % 5 == 0))
            drafts.append(sequence[len(state.token_ids):])
            state.drafts = drafts[-1]
        result.draft_token_ids = drafts
        return result


@pytest.mark.cpu_test
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_scheduler_keeps_drafts_and_their_slots(overlap):
    """Scheduler side alone: drafting rows get the lookahead's slots (writes past them would land in other
    requests' blocks, which the harness catches), drafts become the next step's guesses (under overlap, the
    step right behind a verify step takes them from the device), outputs equal decoding without them, with
    preemption and shared prefixes, nothing leaks."""
    prompts = {f"r{i}": prompt(i % 2, 9 + 4 * (i % 3)) for i in range(6)}
    outputs = {}
    for speculative, num_blocks in [(None, 64), (DRAFT, 64), (DRAFT, 11)]:
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, speculative=speculative)
        driver = (OverlapDriver if overlap else Driver)(scheduler, cyclic)
        driver.runner = DraftingRunner(scheduler, cyclic)
        requests = [make_request(request_id, tokens, max_tokens=16, temperature=0.0)
                    for request_id, tokens in prompts.items()]
        driver.add(*requests)
        driver.run()
        outputs[speculative, num_blocks] = [request.output_token_ids for request in requests]
        assert scheduler.kv_cache.num_free_blocks == num_blocks - 1
        if speculative is not None:
            assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
            assert scheduler.num_preemptions > 0 or num_blocks == 64
            # under overlap a row behind its verify step guesses from that step's drafts (device-guessed)
            assert (scheduler.num_device_guessed > 0) == overlap
    assert outputs[DRAFT, 64] == outputs[DRAFT, 11] == outputs[None, 64]


class DraftingSchedulerMachine(SchedulerMachine):
    """test_scheduler_machine's random arrivals, steps, aborts and invariants, with a draft model's guesses
    (DraftingRunner) instead of n-gram ones."""

    @initialize(setup=configs(), k=st.integers(1, 3))
    def setup(self, setup, k):
        speculative = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=k)
        SchedulerMachine.setup(self, {**setup, "speculative": speculative})
        self.runner = DraftingRunner(self.scheduler, k=k)


TestDraftingSchedulerMachine = DraftingSchedulerMachine.TestCase
TestDraftingSchedulerMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
TestDraftingSchedulerMachine = pytest.mark.cpu_test(TestDraftingSchedulerMachine)


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(precompile=False)
    return {"greedy": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
            "workload": llm.generate(*_workload(), use_tqdm=False)}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_target_as_its_own_draft_is_accepted_with_preemption_and_prefix_caching(reference, async_scheduling):
    llm = make_llm(precompile=False, num_blocks=10, async_scheduling=async_scheduling,
                   speculative_config=spec(TINY_MODEL), max_num_seqs=16, max_num_batched_tokens=64,
                   token_buckets=[64], request_buckets=[16])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference["greedy"])
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and llm.engine.kv_cache.stats.hits > 0
    # The same network guesses: every guess is the target's own greedy token.
    assert scheduler.num_draft_tokens > 0
    assert scheduler.num_accepted_tokens >= 0.95 * scheduler.num_draft_tokens
    # under overlap the greedy rows verify guesses every step: the step behind a verify step takes its
    # token and guesses from that step's device outputs
    assert (scheduler.num_device_guessed > 0) == async_scheduling
    assert_no_leaks(llm)
    # Requests that do not guess (sampling, penalties, logprobs, n > 1) and stops inside accepted runs.
    assert _summary(llm.generate(*_workload(), use_tqdm=False)) == _summary(reference["workload"])
    assert_no_leaks(llm)


@pytest.mark.parametrize("speculative, rate", [(spec(), 0.5), ({**spec(), "quantization": "fp8"}, 0.5),
                                               (eagle_spec(), 0.6)], ids=["draft_model", "fp8_draft_model", "eagle"])
def test_trained_proposers_have_guesses_accepted(reference, speculative, rate):
    """The embedded draft and head agree with the target on 90% and 99.7% of held-out answer tokens
    (teacher-forced; their TRAINING.md): most guesses are accepted, also those made one token behind
    (overlap), those after a first guess, and those after chunked prompts (the head reads each chunk's next
    prompt token from the host). The draft quantized to FP8 at load (speculative.quantization) still
    guesses well."""
    llm = make_llm(precompile=False, num_blocks=10, max_num_batched_tokens=5, max_num_seqs=4, request_buckets=[4],
                   speculative_config=speculative)
    draft_weights = jax.tree.leaves(llm.engine.runner.drafter.params, is_leaf=lambda x: isinstance(x, quant.Fp8Weight))
    assert any(isinstance(w, quant.Fp8Weight) for w in draft_weights) == ("quantization" in speculative)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference["greedy"])
    scheduler = llm.engine.scheduler
    assert rate * scheduler.num_draft_tokens <= scheduler.num_accepted_tokens <= scheduler.num_draft_tokens
    stats = llm.engine.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (scheduler.num_draft_tokens,
                                                                     scheduler.num_accepted_tokens)
    assert_no_leaks(llm)


@pytest.mark.parametrize("speculative", [{**spec(), "draft_tensor_parallel_size": 1}, spec(), eagle_spec()],
                         ids=["draft_whole_on_each_device", "draft_split", "eagle"])
def test_tensor_parallel_greedy_tokens_identical(reference, speculative):
    llm = make_llm(precompile=False, tensor_parallel_size=2, speculative_config=speculative, **ONE_BUCKET)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference["greedy"])
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert_no_leaks(llm)


def random_head(cfg, seed: int = 0) -> dict:
    """Random EAGLE head params of a one-layer config (numpy: nothing to compile), with an fc bias."""
    rng = np.random.default_rng(seed)
    layer = {name: 0.05 * rng.standard_normal(leaf.shape).astype(np.float32)
             for name, leaf in llama.abstract(cfg)["layers"][0].items() if name != "attn_norm"}
    d = cfg.hidden_size
    return {"layer": layer, "fc": 0.05 * rng.standard_normal((2 * d, d)).astype(np.float32),
            "fc_bias": 0.05 * rng.standard_normal(d).astype(np.float32)}


def random_eagle_head(fixture_path, out):
    """A random EAGLE head for an HF fixture (one layer of its shape), written where `out` says."""
    hf = json.loads((fixture_path / "config.json").read_text())
    cfg = registry.config_from_hf({**hf, "num_hidden_layers": 1}, dtype="float32")
    eagle.save_head(random_head(cfg), cfg, out)
    return out


def test_eagle_head_checkpoint_round_trip(tmp_path):
    cfg = eagle.head_config(TINY_EAGLE, "float32")
    params = random_head(cfg, seed=1)
    eagle.save_head(params, cfg, tmp_path)
    loaded = eagle.load_head(tmp_path, eagle.head_config(tmp_path, "float32"), lambda array: array)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(ours), theirs)


@pytest.mark.parametrize("draft", ["llama3_gqa4_tied", "qwen3_gqa1_untied", "eagle"],
                         ids=["itself", "another_family", "random_eagle_head"])
def test_hf_fixture_greedy_tokens_with_a_proposer_of_its_vocabulary(hf_fixture_by_name, draft, tmp_path):
    fixture = hf_fixture_by_name("llama3_gqa4_tied")
    speculative = (eagle_spec(random_eagle_head(fixture.path, tmp_path / "head")) if draft == "eagle"
                   else spec(HF_FIXTURES / draft))
    llm = LLM(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
              precompile=False, progress=False, speculative_config=speculative)
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
    with pytest.raises(ValueError, match="speculative.quantization is for method draft_model"):
        make_llm(precompile=False, speculative_config={**eagle_spec(), "quantization": "fp8"})
    with pytest.raises(ValueError, match="speculative.quantization='int4' is not supported; use fp8"):
        make_llm(precompile=False, speculative_config={**spec(), "quantization": "int4"})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        make_llm(precompile=False, speculative_config={**spec(), "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="method=draft_model is not supported yet with parallel.data > 1"):
        make_llm(precompile=False, data_parallel_size=2, speculative_config=spec())
    narrow = tmp_path / "narrow-head"
    narrow.mkdir()
    hf = json.loads((TINY_EAGLE / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**hf, "hidden_size": 64}))
    with pytest.raises(ValueError, match="the EAGLE head's hidden_size is 64 but the target model's is 128"):
        make_llm(precompile=False, speculative_config=eagle_spec(narrow))
    with pytest.raises(ValueError, match="an EAGLE-1 head has one decoder layer"):
        make_llm(precompile=False, speculative_config=eagle_spec(TINY_DRAFT))
    other = tmp_path / "other-head"  # an fc missing, a final norm too many
    other.mkdir()
    (other / "config.json").write_text((TINY_EAGLE / "config.json").read_text())
    tensors = safetensors.numpy.load_file(TINY_EAGLE / "model.safetensors")
    tensors["norm.weight"] = tensors.pop("fc.weight")[:, 0]
    safetensors.numpy.save_file(tensors, other / "model.safetensors")
    with pytest.raises(ValueError, match=r"not an EAGLE-1 head: missing tensors \['fc.weight'\]; unexpected tensors "
                                         r"\['norm.weight'\]"):
        make_llm(precompile=False, speculative_config=eagle_spec(other))


@pytest.mark.parametrize("speculative, twins", [(spec(k=2), False), (eagle_spec(k=2), False), (spec(k=2), True)],
                         ids=["draft_model", "eagle", "draft_model-twins"])
@pytest.mark.usefixtures("no_jit_dispatches")
def test_no_compiles_after_start_up(reference, speculative, twins):
    """Every program a speculating engine runs was compiled at start-up. `twins`: as on a GPU (`use_twins`),
    where the target's steps and the draft's fill_propose each alternate between two executables of a
    shape (so that back-to-back calls under overlap keep their temporaries apart): both twins run, and the
    tokens do not change."""
    llm = make_llm(speculative_config=speculative, precompile=not twins, **ONE_BUCKET)
    runner = llm.engine.runner
    calls = collections.Counter()
    if twins:
        runner.use_twins = True  # what a GPU platform sets
        runner.precompile(progress=False)
        for key, program in list(runner._compiled.items()):
            if key[0] == "draft_fill_propose":
                runner._compiled[key] = functools.partial(_counted, program, calls, key)
    llm.generate(["1+1="], GREEDY, use_tqdm=False)
    with jax.no_tracing():
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference["greedy"])
        llm.generate(*_workload(), use_tqdm=False)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    if twins:
        assert {key[-1] for key, count in calls.items() if count > 0} == {False, True}, calls
    assert_no_leaks(llm)


def _counted(program, calls: collections.Counter, key, *args):
    calls[key] += 1
    return program(*args)


def test_joined_fill_batch_appends_next_tokens_and_drops_rejected_guesses():
    """draft_model._joined on a step of a speculating row (input token at position 10, 3 guesses, 1 kept)
    and a mid-prompt chunk (no sampling row), padded to 12 tokens and 2 sampling rows: the rejected guesses
    write the null slot, the chunk's and the kept tokens keep theirs, and the speculating row's next token
    is a decode entry after the batch at position 12 (its slot from the row's block table, 13 tokens of
    context), the padding sampling row's entry at position 0 in the null slot."""
    from jaxserve.models.layers import ModelBatch
    from jaxserve.spec_decode.draft_model import _joined

    block_size = 4
    positions = np.array([10, 11, 12, 13, 0, 1, 2, 3, 4, 0, 0, 0], np.int32)
    tables = np.array([[5, 6, 7, 8], [2, 0, 0, 0]], np.int32)
    owner = np.array([0] * 4 + [1] * 5 + [0] * 3)
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    slots[9:] = 0
    batch = ModelBatch(np.arange(100, 112, dtype=np.int32), positions, slots.astype(np.int32),
                       np.array([0, 4, 9], np.int32), np.array([14, 5], np.int32), tables, np.array([0], np.int32))
    rows = np.zeros((4, 4), np.int32)
    rows[:, 0] = [0, 11, 16, 0]  # batch row, position after the input token, capacity, input token index
    tokens, accepted = np.array([77, 1, 2, 3], np.int32), np.array([1, 0, 0, 0], np.int32)
    batch, tokens, accepted, rows = jax.tree.map(jax.numpy.asarray, (batch, tokens, accepted, rows))
    got = jax.tree.map(np.asarray, _joined(batch, tokens, accepted, rows, block_size))
    want_slots = slots.copy()
    want_slots[2:4] = 0
    np.testing.assert_array_equal(got.slot_mapping[:12], want_slots)
    np.testing.assert_array_equal(got.token_ids, [*range(100, 112), 77, 1])
    np.testing.assert_array_equal(got.positions[12:], [12, 0])
    np.testing.assert_array_equal(got.slot_mapping[12:], [8 * block_size, 0])  # (position 12: block 3 of row 0)
    np.testing.assert_array_equal(got.query_start_loc, [0, 4, 9, 13, 14])
    np.testing.assert_array_equal(got.seq_lens, [14, 5, 13, 1])
    np.testing.assert_array_equal(got.block_tables, np.concatenate([tables, tables[[0, 0]]]))
    np.testing.assert_array_equal(got.logits_indices, [12, 13])
