"""The Mosaic TPU ragged paged-attention kernel against the pure-jnp reference, in CPU interpret mode.

Every batch mixes decode rows, chunked prefill over a cached prefix and fresh prompts, with padding
requests (seq_lens 0), padding token rows (NaN queries), permuted pages and NaN in every cache slot no
request owns. A cross-lowering test checks that the kernel lowers for TPU from this CPU host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import layout, reference, tpu

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


reference_attention = jax.jit(reference.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window"))
write_kv = jax.jit(layout.write_kv)


def make_batch(seed, *, num_kv_heads, group, head_dim, page_size, q_lens, cached_lens, pad_tokens=3,
               dtype=jnp.float32, max_blocks=None, num_pages=None):
    """A ragged batch: request r has cached_lens[r] tokens cached and q_lens[r] new ones.

    A request with q_len 0 and cached_len 0 is padding (seq_lens 0). Pages are a random permutation of
    1..P-1 (page 0 is the null page); the block-table tail holds random pages, and every slot no
    request owns is NaN. Fixing max_blocks and num_pages (and the token count) fixes the shapes.
    """
    rng = np.random.default_rng(seed)
    seq_lens = np.array(q_lens) + np.array(cached_lens)
    num_reqs = len(q_lens)
    pages_needed = -(-seq_lens // page_size)
    max_blocks = max_blocks or int(pages_needed.max()) + 1
    num_pages = num_pages or int(pages_needed.sum()) + 4
    free = list(rng.permutation(np.arange(1, num_pages)))
    block_tables = rng.integers(0, num_pages, size=(num_reqs, max_blocks)).astype(np.int32)
    slots = []
    for r in range(num_reqs):
        block_tables[r, : pages_needed[r]] = [free.pop() for _ in range(pages_needed[r])]
        slots += [block_tables[r, pos // page_size] * page_size + pos % page_size for pos in range(seq_lens[r])]
    kv_cache = jnp.full(layout.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim), jnp.nan, dtype)
    k, v = rng.normal(size=(2, len(slots), num_kv_heads, head_dim))
    kv_cache = write_kv(kv_cache, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots))

    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1]) + pad_tokens
    q = rng.normal(size=(num_tokens, num_kv_heads * group, head_dim))
    q[query_start_loc[-1]:] = np.nan
    return (jnp.asarray(q, dtype), kv_cache, jnp.asarray(query_start_loc), jnp.asarray(seq_lens, jnp.int32),
            jnp.asarray(block_tables))


def check(batch, *, sliding_window=None, interpret=True, config=None):
    q, kv_cache, query_start_loc, seq_lens, block_tables = batch
    sm_scale = q.shape[-1] ** -0.5
    expected = reference_attention(
        q, layout.to_reference_layout(kv_cache), query_start_loc, seq_lens, block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window,
    )
    got = tpu.ragged_paged_attention(
        q, kv_cache, query_start_loc, seq_lens, block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret, config=config,
    )
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not jnp.isnan(got).any()
    tol = TOLERANCE[q.dtype.type]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol)
    assert not jnp.any(got[int(query_start_loc[-1]):]), "padding token rows must be zero"


# Decode rows (q 1 over a cache), chunked prefill over a cached prefix, fresh prompts, a padding request
# in the middle and at the end, and a request with nothing scheduled this step (q 0, seq > 0).
MIXED = dict(q_lens=[1, 13, 0, 20, 1, 0, 7, 0], cached_lens=[30, 21, 0, 0, 47, 9, 0, 0])


@pytest.mark.parametrize(
    "group, head_dim, page_size, dtype, config",
    [
        (1, 128, 16, jnp.float32, None),
        (4, 64, 32, jnp.float32, tpu.TuningConfig(block_q=4, pages_per_step=2)),
        (8, 128, 16, jnp.bfloat16, None),
        (4, 128, 32, jnp.bfloat16, tpu.TuningConfig(block_q=3, pages_per_step=1)),
    ],
)
def test_mixed_batch(group, head_dim, page_size, dtype, config):
    batch = make_batch(0, num_kv_heads=2, group=group, head_dim=head_dim, page_size=page_size, dtype=dtype,
                       **MIXED)
    check(batch, config=config)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_query_lengths(seed):
    """Query lengths 1..24 and cached prefixes drawn at random; shapes fixed so the seeds share a compile."""
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(1, 25, size=6)
    cached = rng.integers(0, 50, size=6) * rng.integers(0, 2, size=6)
    batch = make_batch(seed, num_kv_heads=2, group=4, head_dim=64, page_size=16, q_lens=list(q_lens),
                       cached_lens=list(cached), pad_tokens=6 * 24 - int(q_lens.sum()), max_blocks=6, num_pages=40)
    check(batch, config=tpu.TuningConfig(block_q=8, pages_per_step=2))


@pytest.mark.parametrize(
    "group, dtype, window, config",
    [
        (4, jnp.float32, 10, tpu.TuningConfig(block_q=4, pages_per_step=2)),
        (8, jnp.bfloat16, 33, tpu.TuningConfig(block_q=2, pages_per_step=1)),
    ],
)
def test_sliding_window(group, dtype, window, config):
    batch = make_batch(4, num_kv_heads=2, group=group, head_dim=64, page_size=16, dtype=dtype,
                       q_lens=[1, 25, 40, 1, 0], cached_lens=[70, 30, 0, 5, 0])
    check(batch, sliding_window=window, config=config)


def test_decode_only():
    """One token per request, one per work item; cached lengths around page boundaries."""
    decode = make_batch(5, num_kv_heads=2, group=8, head_dim=64, page_size=16, q_lens=[1] * 6,
                        cached_lens=[0, 15, 16, 31, 64, 100], pad_tokens=2)
    check(decode, config=tpu.TuningConfig(block_q=1, pages_per_step=3))


def test_tpu_interpret_mode():
    """The TPU simulator (DMAs, semaphores, NaN-initialised memory, out-of-bounds reads raise)."""
    batch = make_batch(7, num_kv_heads=1, group=4, head_dim=128, page_size=16, q_lens=[1, 9, 0, 3],
                       cached_lens=[20, 10, 0, 0])
    config = tpu.TuningConfig(block_q=4, pages_per_step=2)
    try:
        check(batch, sliding_window=12, interpret=pltpu.InterpretParams(), config=config)
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def test_cross_lowers_for_tpu():
    """Realistic shape: 32 q / 8 kv heads, H 128, page 16, 64 requests of up to 2,048 tokens, bf16."""
    num_q_heads, num_kv_heads, head_dim, page_size, num_reqs, max_blocks, num_tokens = 32, 8, 128, 16, 64, 128, 512
    num_pages = num_reqs * max_blocks + 1
    args = (
        jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct(layout.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_reqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((num_reqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_reqs, max_blocks), jnp.int32),
    )
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", platform="tpu", num_cores=1)
    for sliding_window in (None, 1024):
        fn = functools.partial(tpu.ragged_paged_attention, sm_scale=head_dim**-0.5, sliding_window=sliding_window)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


def test_backend_module_and_validation():
    assert tpu.kv_cache_shape is layout.kv_cache_shape and tpu.write_kv is layout.write_kv
    with pytest.raises(ValueError, match="block_q"):
        tpu.TuningConfig(block_q=0)
    with pytest.raises(ValueError, match="pages_per_step"):
        tpu.TuningConfig(pages_per_step=0)
    q = jnp.zeros((4, 4, 64), jnp.bfloat16)
    kv_cache = jnp.zeros(layout.kv_cache_shape(3, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        tpu.ragged_paged_attention(q, kv_cache, jnp.array([0, 4]), jnp.array([4]), jnp.zeros((1, 1), jnp.int32),
                                   sm_scale=0.125, interpret=True)
