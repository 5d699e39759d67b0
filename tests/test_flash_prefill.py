"""The long-prefill path of `layers.paged_attention`: one request's rows through the flash attention over
its K/V gathered from the paged cache, the other rows through the ragged kernel.

CPU tier: the dispatch with the reference backend (its flash attention is the jnp reference) against the
same step without the option, on a ragged batch whose long request is a later chunk (a cached prefix),
sits between other requests, and shares the step with decode rows, a short prefill, a padding request and
padding rows, over a cache whose unused slots are NaN; the GPU layout's gather against the reference
layout's; an engine with chunked prefill on the HF fixtures (greedy tokens and logits against HF's).
GPU tier (`-m gpu`): the same dispatch with the "pallas" backend (the Mosaic GPU / Triton flash kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models import layers
from pallas_kernels.paged_attention import layout, reference
from tests.test_engine_parity import log_softmax

PAGE, MAX_BLOCKS, NUM_TOKENS = 4, 16, 40
# (q_len, context) per request: a decode row, the long chunk over a 27-token prefix, a short prefill, a
# decode row; then a padding request (seq_len 0). 27 and 20 are not multiples of the page.
REQUESTS = [(1, 13), (24, 27), (3, 0), (1, 40)]
THRESHOLD = 16


def _batch(seed, num_q_heads=4, num_kv_heads=2, head_dim=16, requests=REQUESTS, kv_layout=reference):
    """(q, k, v, kv_cache, batch): this step's q/k/v rows, a cache holding every request's context (NaN in
    every slot no request owns), the step's ModelBatch."""
    rng = np.random.default_rng(seed)
    num_reqs = len(requests) + 1
    num_pages = num_reqs * MAX_BLOCKS + 1
    order = rng.permutation(np.arange(1, num_pages))  # page 0 is the null page padding rows write to
    block_tables = np.zeros((num_reqs, MAX_BLOCKS), np.int32)
    cache = np.full(reference.kv_cache_shape(num_pages, PAGE, num_kv_heads, head_dim), np.nan, np.float32)
    slots, qsl, seq_lens = [], [0], []
    for r, (q_len, context) in enumerate(requests):
        seq_len = context + q_len
        pages = order[r * MAX_BLOCKS: r * MAX_BLOCKS + -(-seq_len // PAGE)]
        block_tables[r, :len(pages)] = pages
        pos = np.arange(context)
        cache[:, pages[pos // PAGE], pos % PAGE] = rng.standard_normal((2, context, num_kv_heads, head_dim))
        pos = np.arange(context, seq_len)
        slots += list(pages[pos // PAGE] * PAGE + pos % PAGE)
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(seq_len)
    qsl.append(qsl[-1])
    seq_lens.append(0)
    num_rows = qsl[-1]
    slots += [i % PAGE for i in range(NUM_TOKENS - num_rows)]  # padding rows: the null page
    q = rng.standard_normal((NUM_TOKENS, num_q_heads, head_dim)).astype(np.float32)
    k, v = rng.standard_normal((2, NUM_TOKENS, num_kv_heads, head_dim)).astype(np.float32)
    if kv_layout is layout:
        cache = np.asarray(cache.transpose(0, 3, 1, 2, 4))  # [2, P, S, K, H] -> [2, K, P, S, H]
    batch = layers.ModelBatch(
        token_ids=jnp.zeros((NUM_TOKENS,), jnp.int32), positions=jnp.zeros((NUM_TOKENS,), jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32), query_start_loc=jnp.asarray(qsl, jnp.int32),
        seq_lens=jnp.asarray(seq_lens, jnp.int32), block_tables=jnp.asarray(block_tables),
        logits_indices=jnp.zeros((1,), jnp.int32))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cache), batch


@functools.partial(jax.jit, static_argnames=("threshold", "backend"))
def _attend(q, k, v, kv_cache, batch, *, threshold, backend="reference", kv_scale=None):
    return layers.paged_attention(q, k, v, kv_cache, batch, sm_scale=0.25, sliding_window=None,
                                  backend=backend, flash_prefill_threshold=threshold, kv_scale=kv_scale)


def _compare(batch_args, backend="reference", atol=1e-5, kv_scale=None, page_axis=1):
    """The step with and without the flash variant: equal caches, outputs within atol. The caches compare
    in float32 (NaN equal to NaN) without the null page (`page_axis`: the layout's page axis), where the
    padding rows' duplicate writes race on a GPU."""
    q, k, v, cache, batch = batch_args
    ragged, ragged_cache = _attend(q, k, v, cache, batch, threshold=0, backend=backend, kv_scale=kv_scale)
    flash, flash_cache = _attend(q, k, v, cache, batch, threshold=THRESHOLD, backend=backend, kv_scale=kv_scale)
    real_pages = lambda c: np.delete(np.asarray(c, np.float32), 0, axis=page_axis)
    np.testing.assert_array_equal(real_pages(flash_cache), real_pages(ragged_cache))
    flash, ragged = np.asarray(flash, np.float32), np.asarray(ragged, np.float32)
    assert not np.isnan(flash).any()
    np.testing.assert_allclose(flash, ragged, atol=atol, rtol=0)
    return flash


def test_long_request_rows_match_the_ragged_path():
    _compare(_batch(0))


def test_long_request_rows_over_an_fp8_cache_match_the_ragged_path():
    # The long request's K/V are dequantized by their per-head scales as they are gathered.
    q, k, v, cache, batch = _batch(1)
    kv_scale = jnp.asarray([[0.5, 2.0], [0.25, 1.5]], jnp.float32)
    _compare((q, k, v, cache.astype(jnp.float8_e4m3fn), batch), atol=1e-4, kv_scale=kv_scale)


def test_the_long_rows_come_from_the_flash_call(monkeypatch):
    # A stand-in flash attention that records its input shapes and answers 7 + q_offset: exactly the long
    # request's rows (the second request's 24, over its 27 cached tokens) carry it; the others are the
    # ragged kernel's.
    seen = {}

    def fake_flash(q, k, v, *, sm_scale, q_offset):
        seen.update(q=q.shape, k=k.shape)
        return jnp.full_like(q, 7.0) + q_offset[0].astype(q.dtype)

    monkeypatch.setattr(layers, "flash_prefill_fn", lambda *args: fake_flash)
    q, k, v, cache, batch = _batch(0)
    out, _ = jax.jit(lambda *a: layers.paged_attention(*a, sm_scale=0.25, sliding_window=None, backend="reference",
                                                       flash_prefill_threshold=THRESHOLD))(q, k, v, cache, batch)
    ragged, _ = _attend(q, k, v, cache, batch, threshold=0)
    assert seen["q"] == (1, NUM_TOKENS, 4, 16) and seen["k"] == (1, MAX_BLOCKS * PAGE, 2, 16)
    long_rows = np.zeros(NUM_TOKENS, bool)
    long_rows[1:25] = True
    np.testing.assert_array_equal(np.asarray(out)[long_rows], 7.0 + 27)
    np.testing.assert_array_equal(np.asarray(out)[~long_rows], np.asarray(ragged)[~long_rows])


def test_no_long_request_takes_the_ragged_path():
    # The step is large enough for the variant, but no request holds THRESHOLD rows: the cond's other side.
    _compare(_batch(1, requests=[(1, 13), (15, 27), (15, 0), (1, 40)]))


def test_the_long_request_first_and_gqa4():
    _compare(_batch(2, num_q_heads=8, num_kv_heads=2, requests=[(30, 33), (2, 5)]))


def test_small_or_decode_steps_compile_without_the_variant():
    q, k, v, cache, batch = _batch(3)
    text = jax.jit(functools.partial(_attend, threshold=NUM_TOKENS + 1)).lower(q, k, v, cache, batch).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    text = jax.jit(functools.partial(_attend, threshold=THRESHOLD)).lower(q, k, v, cache, batch).as_text()
    assert "stablehlo.case" in text or "stablehlo.if" in text


def test_gather_kv_layouts_agree():
    _, _, _, cache, batch = _batch(4)
    heads_major = jnp.asarray(np.asarray(cache).transpose(0, 3, 1, 2, 4))  # the reference's -> layout.py's
    for r in range(len(REQUESTS)):
        seq_len = batch.seq_lens[r]
        k_ref, v_ref = reference.gather_kv(cache, batch.block_tables[r], seq_len)
        k, v = layout.gather_kv(heads_major, batch.block_tables[r], seq_len)
        assert k.shape == (1, MAX_BLOCKS * PAGE, 2, 16)
        np.testing.assert_array_equal(np.asarray(k), np.asarray(k_ref))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v_ref))
        n = int(seq_len) - REQUESTS[r][0]  # the cached context (this step's rows are not written here)
        assert not np.isnan(np.asarray(k[0, :n])).any() and not np.asarray(k[0, int(seq_len):]).any()


def test_flash_prefill_fn_scope():
    assert layers.flash_prefill_fn("reference", None) is not None
    assert layers.flash_prefill_fn("reference", 64) is None  # sliding window
    assert layers.flash_prefill_fn("tpu", None) is None


@pytest.mark.parametrize("hf_fixture", ["llama3_gqa4_tied", "qwen3_gqa1_untied"], indirect=True)
def test_engine_greedy_matches_hf_with_flash_prefill(hf_fixture, monkeypatch):
    # A 16-token budget spreads the 17- and 33-token prompts over steps, mixed with the others' decodes: their
    # later chunks (>= 8 rows) attend to their cached prefix through the flash path. One engine precompiles,
    # so its start-up also runs the long-prefill branch once (precompile.warm) before the prompts.
    flash_steps = []
    original = layers.flash_prefill_fn
    monkeypatch.setattr(layers, "flash_prefill_fn", lambda *args: flash_steps.append(args) or original(*args))
    llm = LLM(model=hf_fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[8, 16], request_buckets=[4],
              precompile=hf_fixture.name == "llama3_gqa4_tied", progress=False, flash_prefill_token_threshold=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in hf_fixture.prompts], params, use_tqdm=False)
    assert flash_steps, "no step compiled the flash prefill variant"
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_fixture.generated[i][:12], f"{hf_fixture.name} prompt {i}"
        reference_logprobs = log_softmax(hf_fixture.logits[i])[len(hf_fixture.prompts[i]) - 1:]
        ours = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        expected = [reference_logprobs[step, token] for step, token in enumerate(completion.token_ids)]
        np.testing.assert_allclose(ours, expected, atol=2e-4)


def test_threshold_is_validated():
    from jaxserve.config import RunnerConfig
    with pytest.raises(ValueError, match="flash_prefill_token_threshold must be >= 0"):
        RunnerConfig(flash_prefill_token_threshold=-1)


def test_default_threshold_is_on_for_the_gpu_kernels_only(monkeypatch):
    from jaxserve.config import FLASH_PREFILL_DEFAULT_TOKENS
    from jaxserve.runner.device_setup import flash_prefill_threshold
    assert flash_prefill_threshold(None, "reference") == 0
    assert flash_prefill_threshold(8, "reference") == 8 and flash_prefill_threshold(0, "pallas") == 0
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert flash_prefill_threshold(None, "pallas") == FLASH_PREFILL_DEFAULT_TOKENS
    assert flash_prefill_threshold(None, "reference") == 0
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert flash_prefill_threshold(None, "pallas") == 0


gpu_only = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_q_heads,head_dim,dtype", [(8, 128, jnp.bfloat16), (4, 64, jnp.float32)],
                         ids=["mosaic_bf16", "triton_f32"])
def test_gpu_long_request_rows_match_the_ragged_path(num_q_heads, head_dim, dtype):
    q, k, v, cache, batch = _batch(5, num_q_heads=num_q_heads, head_dim=head_dim, kv_layout=layout)
    args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), cache.astype(dtype), batch)
    _compare(args, backend="pallas", atol=2e-2 if dtype == jnp.bfloat16 else 2e-3, page_axis=2)
