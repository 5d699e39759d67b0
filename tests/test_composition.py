"""The composition matrix: every mechanism on main run together with the others, on a dense and a
mixture-of-experts HF fixture, against transformers' greedy tokens.

Mechanisms: overlap scheduling (async) or the sync loop; prefix caching (a second round of the same
prompts must hit); preemption (a KV pool too small for the batch forces it); chunked prefill (a 16-token
budget splits every prompt) or whole prompts; tensor parallelism over 1 or 2 (fake CPU) devices; expert
parallelism over 1 or 2 shards (MoE only: each shard its own scheduler and KV pool, so those rows send
every prompt twice to put both pools under pressure); speculative decoding: n-gram with up to 3 guesses
(lookups of 1-3 tokens, so guesses are made), a draft model (the fixture drafting for itself) or an EAGLE
head (random), greedy: the tokens must not change. The rows cover every pair of settings across the
two fixtures rather than the full product, which would cost minutes of compiling. A mechanism added later
(KV tiers, FP8, the flash prefill of long chunks) gets a column here; a combination that cannot work is refused at start, and
its row asserts the message.

The server's mechanisms compose with these in their own suites: the engine in its own process
(`server.engine_process`) with prefix caching, n > 1, logprobs, data parallelism and KV tiers in
test_engine_process.py; prefill/decode roles (all four instances in engine processes) with n-gram
speculation and transfers on both paths in test_pd_router.py.
"""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.test_spec_draft import random_eagle_head

DENSE = "llama3_gqa4_tied"
MOE = "qwen2_moe_8x4_shared"
NEW_TOKENS = 12
# One token bucket for every engine, chunked (a 16-token budget) or not (64): a chunked step is padded to
# 64 tokens, so engines that differ only in the budget run the same compiled programs.
TOKEN_BUCKETS = [64]

#        fixture, overlap, prefix caching, forced preemption, chunked prefill, tensor parallel, expert parallel,
#        speculative guesses
MATRIX = [
    (DENSE, True, True, False, True, 1, 1, 3),
    (DENSE, False, True, True, True, 2, 1, 3),
    (DENSE, True, False, True, False, 2, 1, 0),
    (DENSE, False, False, False, False, 1, 1, 3),
    (DENSE, True, True, False, True, 1, 2, 0),  # refused: no experts to shard
    (MOE, True, True, True, True, 1, 1, 3),
    (MOE, False, True, False, False, 2, 1, 3),
    (MOE, True, False, True, True, 2, 1, 0),
    (MOE, False, False, True, False, 1, 1, 0),
    (MOE, True, True, True, True, 1, 2, 0),
    (MOE, False, False, True, False, 2, 2, 0),
    (MOE, True, True, False, True, 2, 2, 0),
    (MOE, True, True, False, True, 1, 2, 3),  # refused: speculation with expert parallelism not yet
    # The model proposers: "draft2" (the fixture drafting for itself, k = 2: every guess accepted) and
    # "eagle2" (a random EAGLE head of the fixture's shape, k = 2: guesses made, few accepted).
    (DENSE, True, True, True, True, 2, 1, "draft2"),
    (DENSE, False, False, True, False, 1, 1, "eagle2"),
    (DENSE, True, True, True, True, 2, 1, "eagle3_k2"),  # a random EAGLE-3 head over both layers, k = 2
    (MOE, False, True, False, True, 1, 1, "draft2"),
    (MOE, True, True, False, True, 1, 2, "draft2"),  # refused: speculation with expert parallelism not yet
]

def _id(row) -> str:
    name, overlap, caching, preempt, chunked, tp, ep, guesses = row
    return "-".join([("moe" if name == MOE else "dense"), "overlap" if overlap else "sync",
                     "cache" if caching else "nocache", "preempt" if preempt else "roomy",
                     "chunked" if chunked else "whole", f"tp{tp}", f"ep{ep}", f"spec{guesses}"])


@pytest.mark.parametrize("row", MATRIX, ids=[_id(row) for row in MATRIX])
def test_mechanisms_compose(row, request):
    _run_row(row, request)


def _run_row(row, request, **extra):
    """One MATRIX row (`extra`: more LLM options) against HF's greedy tokens; returns the LLM (None where the
    row is refused)."""
    name, overlap, caching, preempt, chunked, tp, ep, guesses = row
    if tp * ep > len(jax.devices()):
        pytest.skip(f"needs {tp * ep} devices")
    fixture = request.getfixturevalue("hf_fixture_by_name")(name)
    prompts = fixture.prompts
    prompt_blocks = sum(-(-len(p) // 4) for p in prompts)
    final_blocks = sum(-(-(len(p) + NEW_TOKENS) // 4) for p in prompts)
    # Preemption: every prompt fits (block 0 is the null block), their generated tokens do not, so running
    # requests run out of blocks and the latest is preempted.
    # Expert shards split the prompts (and the copies share prefix blocks): the least max_model_len allows.
    num_blocks = (prompt_blocks + 3 if ep == 1 else 64 // 4 + 1) if preempt else (2 * final_blocks + 1)
    budget = 16 if chunked else 64
    options = dict(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
                   num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4, token_buckets=TOKEN_BUCKETS,
                   request_buckets=[4], precompile=False, progress=False, async_scheduling=overlap,
                   enable_prefix_caching=caching, tensor_parallel_size=tp, **{"parallel.expert": ep}, **extra)
    if guesses == "eagle3_k2":  # (tests/test_spec_eagle3.py)
        from tests.test_spec_eagle3 import random_eagle3_head
        head = random_eagle3_head(fixture.path, request.getfixturevalue("tmp_path") / "eagle3")
        options["speculative_config"] = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    elif isinstance(guesses, str):  # a model proposer
        method, k = guesses[:-1], int(guesses[-1])
        model = (fixture.path if method == "draft" else
                 random_eagle_head(fixture.path, request.getfixturevalue("tmp_path") / "eagle"))
        options["speculative_config"] = {"method": {"draft": "draft_model", "eagle": "eagle"}[method],
                                         "model": str(model), "num_speculative_tokens": k}
    elif guesses:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": guesses,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if name == DENSE and ep > 1:
        with pytest.raises(ValueError, match="shards the experts of MoE layers, but LlamaForCausalLM has none"):
            LLM(**options)
        return None
    if guesses and ep > 1:
        with pytest.raises(ValueError, match="speculative decoding is not supported yet with parallel.expert"):
            LLM(**options)
        return None
    llm = LLM(**options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts] * (2 if ep > 1 else 1)
    first = llm.generate(requests, params, use_tqdm=False)
    second = llm.generate(requests, params, use_tqdm=False)
    for round_outputs in (first, second):
        for i, out in enumerate(round_outputs):
            want = fixture.generated[i % len(prompts)][:NEW_TOKENS]
            assert out.outputs[0].token_ids == want, f"{_id(row)} prompt {i}"
    stats = llm.engine.stats()
    if preempt:
        assert stats.num_preemptions > 0, "the small KV pool was meant to force preemption"
    if caching:
        assert stats.prefix_cache_hits > 0
        if not preempt:
            assert all(out.num_cached_tokens > 0 for out in second)
    else:
        assert stats.prefix_cache_hits == 0 and all(out.num_cached_tokens == 0 for out in second)
    assert stats.kv_cache_usage == 0.0  # every block returned
    if guesses == "draft2":  # the target drafting for itself guesses right
        assert stats.spec_accepted_tokens > 0
    if guesses:
        assert stats.spec_draft_tokens > 0, "the proposer was meant to make guesses"
    else:
        assert stats.spec_draft_tokens == 0
    return llm


# ---------------------------------------------------------------- the flash prefill column
# runner.flash_prefill_token_threshold (on by default on GPUs): with a 16-token budget the 17- and
# 33-token prompts prefill in chunks, and a chunk of at least 8 rows of one request attends to its cached
# prefix through the flash attention (the jnp reference on a CPU) inside lax.cond. Each row checks, by a
# callback on the flash branch, that the branch ran, with the mechanisms of its MATRIX-style settings.
FLASH_THRESHOLD = 8
FLASH_MATRIX = [
    (DENSE, True, True, True, True, 2, 1, "draft2"),
    (DENSE, False, True, False, True, 1, 1, 3),
    (DENSE, True, True, True, True, 1, 1, "eagle3_k2"),
    (MOE, True, True, True, True, 2, 1, 0),
    (MOE, False, True, True, True, 1, 2, 0),
]
_FLASH_RUNS = []  # one entry per execution of the flash branch (any engine of this module)


@pytest.fixture
def flash_runs(monkeypatch):
    """Executions of the flash prefill branch so far: its flash attention wrapped (at trace time) with a
    callback, which runs only when lax.cond takes the branch."""
    from jaxserve.models import layers

    original = layers.flash_prefill_fn

    def counted(*args):
        flash = original(*args)

        def run(q, k, v, **kwargs):
            jax.debug.callback(lambda: _FLASH_RUNS.append(1))
            return flash(q, k, v, **kwargs)
        return run

    monkeypatch.setattr(layers, "flash_prefill_fn", counted)
    return lambda: len(_FLASH_RUNS)


@pytest.mark.parametrize("row", FLASH_MATRIX, ids=[_id(row) for row in FLASH_MATRIX])
def test_flash_prefill_composes(row, request, flash_runs):
    before = flash_runs()
    llm = _run_row(row, request, flash_prefill_token_threshold=FLASH_THRESHOLD)
    assert llm.engine.runner.flash_prefill_threshold == FLASH_THRESHOLD
    assert flash_runs() > before, "no chunk took the flash prefill branch"


# ---------------------------------------------------------------- the KV cache tiers column
# The host tier (a small device pool pushes blocks there; preempted requests swap or recompute) with every
# other mechanism, speculative decoding's three proposers included (a block carries a draft model's or EAGLE
# head's K/V with the target's) and expert parallelism (each shard its own host tier; those rows send every
# prompt twice, as above). Tiers hold prefix-cache blocks, so they need prefix caching (refused without it).
# Loads are held to one block a step, so a returning prompt waits while its host blocks load over several
# steps beside the running requests.

#              fixture, overlap, preemption mode, chunked prefill, tensor parallel, expert parallel, guesses
TIERS_MATRIX = [
    (DENSE, True, "swap", True, 1, 1, 0),
    (DENSE, False, "auto", False, 2, 1, 0),
    (DENSE, True, "recompute", False, 2, 1, 0),
    (MOE, False, "swap", True, 2, 1, 0),
    (MOE, True, "auto", False, 1, 1, 0),
    (DENSE, True, "swap", True, 1, 1, 3),
    (DENSE, True, "auto", False, 2, 1, "draft2"),
    (DENSE, True, "swap", False, 1, 1, "eagle2"),
    (MOE, True, "swap", True, 1, 2, 0),
    (MOE, False, "auto", False, 2, 2, 0),
]


def _tiers_id(row) -> str:
    name, overlap, mode, chunked, tp, ep, guesses = row
    return "-".join([("moe" if name == MOE else "dense"), "overlap" if overlap else "sync", mode,
                     "chunked" if chunked else "whole", f"tp{tp}", f"ep{ep}", f"spec{guesses}"])


@pytest.mark.parametrize("row", TIERS_MATRIX, ids=[_tiers_id(row) for row in TIERS_MATRIX])
def test_kv_tiers_compose(row, request, monkeypatch):
    from jaxserve.runner import kv_transfer

    name, overlap, mode, chunked, tp, ep, guesses = row
    if tp * ep > len(jax.devices()):
        pytest.skip(f"needs {tp * ep} devices")
    monkeypatch.setattr(kv_transfer, "LOAD_BYTES_PER_STEP", 1)  # (one block a step)
    fixture = request.getfixturevalue("hf_fixture_by_name")(name)
    prompts = fixture.prompts
    budget = 16 if chunked else 64
    # Every prompt fits, their generated tokens do not: preemption, and each round evicts the other's blocks.
    # Expert shards split the prompts: the least max_model_len allows.
    num_blocks = sum(-(-len(p) // 4) for p in prompts) + 3 if ep == 1 else 64 // 4 + 1
    options = dict(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
                   num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4, token_buckets=TOKEN_BUCKETS,
                   request_buckets=[4], precompile=False, progress=False, async_scheduling=overlap,
                   tensor_parallel_size=tp, host_kv_gib=1 / 1024, preemption_mode=mode, prefix_hash_seed=1,
                   **{"parallel.expert": ep})
    if isinstance(guesses, str):  # a model proposer, as in MATRIX
        method, k = guesses[:-1], int(guesses[-1])
        model = (fixture.path if method == "draft" else
                 random_eagle_head(fixture.path, request.getfixturevalue("tmp_path") / "eagle"))
        options["speculative_config"] = {"method": {"draft": "draft_model", "eagle": "eagle"}[method],
                                         "model": str(model), "num_speculative_tokens": k}
    elif guesses:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": guesses,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(**options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts] * (2 if ep > 1 else 1)
    for _ in range(2):
        outputs = llm.generate(requests, params, use_tqdm=False)
        for i, out in enumerate(outputs):
            want = fixture.generated[i % len(prompts)][:NEW_TOKENS]
            assert out.outputs[0].token_ids == want, f"{_tiers_id(row)} prompt {i}"
    stats = llm.engine.stats()
    kv = stats.kv_cache
    assert stats.num_preemptions > 0, "the small KV pool was meant to force preemption"
    assert kv.host_bytes_in > 0 and kv.host_hits > 0, "blocks were meant to go to the host tier and come back"
    if mode == "swap":
        assert kv.swaps_out > 0 and kv.swaps_in == kv.swaps_out
    elif mode == "recompute":
        assert kv.swaps_out == 0
    if guesses:
        assert stats.spec_draft_tokens > 0, "the proposer was meant to make guesses"
    if guesses == "draft2":  # the target drafting for itself guesses right, its K/V loaded with the target's
        assert stats.spec_accepted_tokens > 0
    assert stats.kv_cache_usage == 0.0
    engine = llm.engine
    assert engine.kv_transfer.load_budget == 1
    engine.kv_transfer.poll(engine.tier_link, wait=True)
    assert len(engine.kv_transfer.shard_tiers) == ep
    for tiers in engine.kv_transfer.shard_tiers:
        tiers.host.check()


def test_kv_tiers_need_prefix_caching():
    with pytest.raises(ValueError, match="need cache.enable_prefix_caching: true"):
        LLM(host_kv_gib=1 / 1024, enable_prefix_caching=False, progress=False)


# ---------------------------------------------------------------- the FP8 weights column
# Online FP8 weights (model.quantization: fp8) with the other mechanisms. FP8 changes the tokens from
# transformers' float32 ones, so each row is compared with the same FP8 model run plainly (sync loop, no
# prefix caching, roomy pool, whole prompts, one device), computed once. MoE models refuse FP8 weights.

#             overlap, prefix caching, forced preemption, chunked prefill, tensor parallel
FP8_MATRIX = [
    (True, True, True, True, 2),
    (False, True, False, True, 1),
    (True, False, True, False, 2),
]
_fp8_baseline: dict[str, list] = {}


def _fp8_tokens(fixture, overlap, caching, preempt, chunked, tp):
    prompts = fixture.prompts
    prompt_blocks = sum(-(-len(p) // 4) for p in prompts)
    final_blocks = sum(-(-(len(p) + NEW_TOKENS) // 4) for p in prompts)
    budget = 16 if chunked else 64
    llm = LLM(model=fixture.path, dtype="float32", quantization="fp8", skip_tokenizer_init=True, max_model_len=64,
              block_size=4, num_blocks=prompt_blocks + 3 if preempt else 2 * final_blocks + 1,
              max_num_batched_tokens=budget, max_num_seqs=4, token_buckets=TOKEN_BUCKETS, request_buckets=[4],
              precompile=False, progress=False, async_scheduling=overlap, enable_prefix_caching=caching,
              tensor_parallel_size=tp)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    rounds = [[out.outputs[0].token_ids for out in llm.generate(requests, params, use_tqdm=False)] for _ in range(2)]
    return rounds, llm.engine.stats()


@pytest.mark.parametrize("row", FP8_MATRIX, ids=["-".join(map(str, row)) for row in FP8_MATRIX])
def test_fp8_weights_compose(row, hf_fixture_by_name):
    overlap, caching, preempt, chunked, tp = row
    if tp > len(jax.devices()):
        pytest.skip(f"needs {tp} devices")
    fixture = hf_fixture_by_name(DENSE)
    if DENSE not in _fp8_baseline:
        _fp8_baseline[DENSE] = _fp8_tokens(fixture, False, False, False, False, 1)[0][0]
    rounds, stats = _fp8_tokens(fixture, *row)
    assert rounds[0] == rounds[1] == _fp8_baseline[DENSE]
    if preempt:
        assert stats.num_preemptions > 0
    assert (stats.prefix_cache_hits > 0) == caching


# ---------------------------------------------------------------- the FP8 KV cache column
# cache.kv_cache_dtype: fp8 with the other mechanisms. The fp8 cache changes the numerics (not transformers'
# tokens any more), so each row must give the tokens of a plain fp8 engine (sync, roomy pool, whole prompts,
# one device) on the same fixture; fp8 blocks move through the host tier as raw bytes (static scales).

#              fixture, overlap, prefix caching, forced preemption, chunked prefill, tensor parallel, extra
FP8KV_MATRIX = [
    (DENSE, True, True, True, True, 2, None),
    (DENSE, False, True, True, False, 1, "swap"),  # host tier, swap preemption
    (MOE, True, True, True, True, 1, "ngram3"),
    (MOE, False, False, False, True, 2, None),
    (DENSE, True, True, True, True, 2, "fp8w"),  # FP8 weights too: against a plain engine with both
    (MOE, True, True, True, True, 2, "flash"),  # the flash prefill over dequantized fp8 K/V
]
_fp8kv_baselines: dict[tuple[str, bool], list[list[int]]] = {}


def _fp8kv_id(row) -> str:
    name, overlap, caching, preempt, chunked, tp, extra = row
    return "-".join([("moe" if name == MOE else "dense"), "overlap" if overlap else "sync",
                     "cache" if caching else "nocache", "preempt" if preempt else "roomy",
                     "chunked" if chunked else "whole", f"tp{tp}", extra or "plain"])


def _fp8kv_generate(fixture, *, overlap=False, caching=True, preempt=False, chunked=False, tp=1, extra=None):
    prompts = fixture.prompts
    num_blocks = sum(-(-len(p) // 4) for p in prompts) + 3 if preempt else 2 * sum(
        -(-(len(p) + NEW_TOKENS) // 4) for p in prompts) + 1
    budget = 16 if chunked else 64
    options = dict(model=fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
                   num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4, token_buckets=TOKEN_BUCKETS,
                   request_buckets=[4], precompile=False, progress=False, async_scheduling=overlap,
                   enable_prefix_caching=caching, tensor_parallel_size=tp, kv_cache_dtype="fp8")
    if extra == "swap":
        options.update(host_kv_gib=1 / 1024, preemption_mode="swap", prefix_hash_seed=1)
    elif extra == "ngram3":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif extra == "fp8w":
        options["quantization"] = "fp8"
    elif extra == "flash":
        options["flash_prefill_token_threshold"] = FLASH_THRESHOLD
    llm = LLM(**options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    rounds = [[o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)] for _ in range(2)]
    return llm, rounds


@pytest.mark.parametrize("row", FP8KV_MATRIX, ids=[_fp8kv_id(row) for row in FP8KV_MATRIX])
def test_fp8kv_composes(row, request, flash_runs):
    name, overlap, caching, preempt, chunked, tp, extra = row
    if tp > len(jax.devices()):
        pytest.skip(f"needs {tp} devices")
    fixture = request.getfixturevalue("hf_fixture_by_name")(name)
    key = (name, extra == "fp8w")
    if key not in _fp8kv_baselines:
        _fp8kv_baselines[key] = _fp8kv_generate(fixture, extra="fp8w" if key[1] else None)[1][0]
    want = _fp8kv_baselines[key]
    flash_before = flash_runs()
    llm, rounds = _fp8kv_generate(fixture, overlap=overlap, caching=caching, preempt=preempt, chunked=chunked,
                                  tp=tp, extra=extra)
    assert (flash_runs() > flash_before) == (extra == "flash"), "the flash branch runs in the flash row only"
    assert all(c.dtype == jax.numpy.float8_e4m3fn for c in llm.engine.runner.kv_caches)
    for tokens in rounds:
        assert tokens == want, _fp8kv_id(row)
    stats = llm.engine.stats()
    if preempt:
        assert stats.num_preemptions > 0, "the small KV pool was meant to force preemption"
    if caching:
        assert stats.prefix_cache_hits > 0
    if extra == "swap":
        assert stats.kv_cache.swaps_out > 0 and stats.kv_cache.swaps_in == stats.kv_cache.swaps_out
    if extra == "ngram3":
        assert stats.spec_draft_tokens > 0
    assert stats.kv_cache_usage == 0.0
