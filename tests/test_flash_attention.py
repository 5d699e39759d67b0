"""pallas_kernels/flash_attention: the Triton and Mosaic GPU kernels against the pure-jnp reference.

CPU tier: `interpret=True` on tiny shapes with small tiles, so every path runs (several KV tiles,
the unmasked/masked split, block_q != block_k, T and H padding, lengths, NaN past the lengths, queries
at an offset over a longer K/V), plus cross-lowering gates for `cuda` (lowered from this CPU host). GPU
tier (`-m gpu`): the compiled kernels at serving-sized tiles, fresh prompts and chunks at an offset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import FlashAttentionConfig, flash_attention, flash_attention_reference
from pallas_kernels.flash_attention import mosaic_gpu, on_hopper

# NOTE: JAX 0.11 warns on every Triton lowering that the backend is deprecated.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("fast_cpu_compiles")]

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}  # relative L2 error
reference = jax.jit(flash_attention_reference, static_argnames=("causal", "sm_scale"))


def _inputs(seed, batch, tokens, q_heads, kv_heads, head_dim, dtype, kv_tokens=None):
    rng = np.random.default_rng(seed)
    kv_tokens = tokens if kv_tokens is None else kv_tokens
    shapes = [(batch, tokens, q_heads, head_dim)] + 2 * [(batch, kv_tokens, kv_heads, head_dim)]
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


def _poison_past(x, seq_lens):
    """NaN in every row at or past the sequence's length: the kernel must never read it unmasked."""
    valid = jnp.arange(x.shape[1])[None, :] < seq_lens[:, None]
    return jnp.where(valid[:, :, None, None], x, jnp.nan)


def _check(out, ref, dtype, seq_lens=None, q_offset=None):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), "NaN in the output"
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < TOLERANCE[dtype], f"relative L2 error {rel:.2e}"
    if seq_lens is not None:
        offsets = np.zeros(len(seq_lens), int) if q_offset is None else np.asarray(q_offset)
        for b, (length, offset) in enumerate(zip(np.asarray(seq_lens), offsets)):
            assert (out[b, max(length - offset, 0):] == 0).all(), f"padding rows of sequence {b} are not zero"


# (q heads, kv heads, head dim, dtype, tiles): GQA ratios 1/4/8, H 64/128, both tile orders.
CASES = [
    (4, 4, 64, jnp.float32, (16, 16)),
    (8, 2, 128, jnp.float32, (32, 16)),
    (8, 1, 64, jnp.float32, (16, 32)),
    (4, 4, 128, jnp.bfloat16, (16, 32)),
    (8, 2, 64, jnp.bfloat16, (16, 16)),
    (8, 1, 128, jnp.bfloat16, (32, 16)),
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,dtype,tiles", CASES)
def test_causal_matches_reference(q_heads, kv_heads, head_dim, dtype, tiles):
    # T = 72 is not a multiple of the tiles: the wrapper pads and masks the tail.
    q, k, v = _inputs(0, 2, 72, q_heads, kv_heads, head_dim, dtype)
    config = FlashAttentionConfig(block_q=tiles[0], block_k=tiles[1], num_warps=4, num_stages=2)
    out = flash_attention(q, k, v, config=config, interpret=True)
    _check(out, reference(q, k, v), dtype)


@pytest.mark.parametrize("dtype,tiles", [(jnp.float32, (16, 32)), (jnp.bfloat16, (32, 16))])
def test_seq_lens_with_nan_past_the_end(dtype, tiles):
    seq_lens = jnp.array([64, 37, 1, 0], jnp.int32)  # full, mid-tile, one token, empty
    q, k, v = _inputs(1, 4, 64, 8, 2, 64, dtype)
    q, k, v = (_poison_past(x, seq_lens) for x in (q, k, v))
    config = FlashAttentionConfig(block_q=tiles[0], block_k=tiles[1], num_warps=4, num_stages=2)
    out = flash_attention(q, k, v, seq_lens=seq_lens, config=config, interpret=True)
    clean = [jnp.nan_to_num(x) for x in (q, k, v)]
    _check(out, reference(*clean, seq_lens=seq_lens), dtype, seq_lens)


# Chunks at an offset: q row i at position q_offset + i over keys [0, q_offset + i] of a longer K/V.
# Offsets 0, mid-tile, and one whose last rows pass the K/V length (padding rows: zeros).
OFFSETS = [0, 37, 90]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,dtype,tiles", [
    (8, 2, 64, jnp.float32, (16, 32)), (4, 1, 128, jnp.bfloat16, (32, 16))])
def test_offset_matches_reference(q_heads, kv_heads, head_dim, dtype, tiles):
    q, k, v = _inputs(12, 3, 40, q_heads, kv_heads, head_dim, dtype, kv_tokens=120)  # Tq = 40: padded
    q_offset = jnp.array(OFFSETS, jnp.int32)
    config = FlashAttentionConfig(block_q=tiles[0], block_k=tiles[1], num_warps=4, num_stages=2)
    out = flash_attention(q, k, v, q_offset=q_offset, config=config, interpret=True)
    _check(out, reference(q, k, v, q_offset=q_offset), dtype, jnp.full((3,), 120), q_offset)


def test_offset_with_seq_lens_and_nan_past_the_end():
    # The engine's case: K/V gathered into a static bucket, valid up to seq_lens, garbage after.
    seq_lens = jnp.array([64, 53, 30], jnp.int32)
    q_offset = seq_lens - jnp.array([24, 24, 7], jnp.int32)  # the chunk is the last rows of each sequence
    q, k, v = _inputs(13, 3, 24, 8, 2, 64, jnp.float32, kv_tokens=96)
    k, v = (_poison_past(x, seq_lens) for x in (k, v))
    config = FlashAttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)
    out = flash_attention(q, k, v, seq_lens=seq_lens, q_offset=q_offset, config=config, interpret=True)
    clean = [jnp.nan_to_num(x) for x in (q, k, v)]
    _check(out, reference(*clean, seq_lens=seq_lens, q_offset=q_offset), jnp.float32, seq_lens, q_offset)


def test_reference_offset_is_a_slice_of_the_fresh_prompt():
    # A chunk's rows at an offset equal the same rows of the whole prompt attended at once.
    q, k, v = _inputs(14, 1, 48, 4, 2, 32, jnp.float32)
    whole = reference(q, k, v)
    chunk = reference(q[:, 20:36], k, v, q_offset=jnp.array([20], jnp.int32))
    np.testing.assert_allclose(chunk, whole[:, 20:36], atol=1e-6, rtol=1e-6)


def test_non_causal_and_odd_head_dim():
    q, k, v = _inputs(2, 1, 48, 4, 2, 96, jnp.float32)  # H = 96 is padded to 128 and sliced back
    config = FlashAttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)
    out = flash_attention(q, k, v, causal=False, sm_scale=0.3, config=config, interpret=True)
    _check(out, reference(q, k, v, causal=False, sm_scale=0.3), jnp.float32)


def test_default_config_on_a_short_prompt():
    q, k, v = _inputs(3, 1, 40, 4, 1, 64, jnp.float32)  # default 128-row tiles shrink to 64
    _check(flash_attention(q, k, v, interpret=True), reference(q, k, v), jnp.float32)


def test_reference_matches_jax_nn():
    seq_lens = jnp.array([24, 9], jnp.int32)
    q, k, v = _inputs(4, 2, 24, 8, 2, 32, jnp.float32)
    ref = reference(q, k, v, seq_lens=seq_lens)
    expected = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=seq_lens, key_value_seq_lengths=seq_lens,
        implementation="xla")
    for b, length in enumerate(np.asarray(seq_lens)):  # jax.nn leaves padding rows unspecified
        np.testing.assert_allclose(ref[b, :length], expected[b, :length], atol=1e-5, rtol=1e-5)


def test_config_validates():
    for bad in (dict(block_q=96), dict(block_k=8), dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(ValueError):
            FlashAttentionConfig(**bad)
    hash(FlashAttentionConfig())  # static argument of a jitted function


def test_rejects_bad_shapes():
    q, k, v = _inputs(5, 1, 32, 8, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v, interpret=True)
    q, k, v = _inputs(5, 1, 32, 8, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="q_offset"):
        flash_attention(q, k[:, :16], v[:, :16], interpret=True)
    with pytest.raises(ValueError, match=r"q_offset must be \[B\]"):
        flash_attention(q, k, v, q_offset=jnp.zeros((2,), jnp.int32), interpret=True)


@pytest.mark.parametrize("with_lens", [False, True])
def test_lowers_for_cuda_without_layout_copies(with_lens):
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    q = jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    args = (q, kv, kv) + ((jax.ShapeDtypeStruct((1,), jnp.int32),) if with_lens else ())

    def fn(q, k, v, seq_lens=None):
        return flash_attention(q, k, v, seq_lens=seq_lens)

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.transpose" not in text and "stablehlo.pad" not in text  # reads [B, T, N, H] in place


# Mosaic GPU kernel (TMA + wgmma): GPU interpret mode on the CPU simulates its warpgroups,
# barriers, TMA copies and wgmma (P staged through SMEM there, kept in registers on the device).


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,tokens,config", [
    (4, 2, 64, 200, mosaic_gpu.MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=2)),
    (2, 1, 64, 256, mosaic_gpu.MosaicAttentionConfig(block_kv=64, pingpong=False)),
], ids=["gqa2_hd64_pad", "no_pingpong"])
def test_mosaic_interpret_matches_reference(q_heads, kv_heads, head_dim, tokens, config):
    q, k, v = _inputs(8, 1, tokens, q_heads, kv_heads, head_dim, jnp.bfloat16)
    out = mosaic_gpu.flash_attention(q, k, v, config=config, interpret=True)
    _check(out, reference(q, k, v), jnp.bfloat16)


def test_mosaic_interpret_offset_matches_reference():
    # GQA 2, offsets mid-tile (5: rows cross two diagonal tiles) and past the K/V end (190 + 72 > 256:
    # the last rows are padding, zeros), Tq = 72 padded to two q tiles, 3 stages, ping-pong.
    q, k, v = _inputs(15, 2, 72, 4, 2, 64, jnp.bfloat16, kv_tokens=256)
    q_offset = jnp.array([5, 190], jnp.int32)
    config = mosaic_gpu.MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=3)
    out = mosaic_gpu.flash_attention(q, k, v, q_offset=q_offset, config=config, interpret=True)
    _check(out, reference(q, k, v, q_offset=q_offset), jnp.bfloat16, jnp.full((2,), 256), q_offset)


def test_mosaic_outside_its_scope_runs_triton():
    q, k, v = _inputs(9, 1, 40, 3, 3, 64, jnp.float32)  # float32, odd G: the Triton kernel
    assert not mosaic_gpu.supports(q, k, causal=True, seq_lens=None)
    _check(mosaic_gpu.flash_attention(q, k, v, interpret=True), reference(q, k, v), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 64"):
        mosaic_gpu.MosaicAttentionConfig(block_q=32)


def test_mosaic_lowers_for_cuda():
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    q = jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
        text = jax.jit(mosaic_gpu.flash_attention).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text


def test_mosaic_lowers_for_cuda_with_an_offset():
    # A prefill chunk of the 8B shape over a 32K-position prefix bucket (no pad: the tiles divide both).
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    q = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 32768, 8, 128), jnp.bfloat16)
    offset = jax.ShapeDtypeStruct((1,), jnp.int32)

    def fn(q, k, v, q_offset):
        return mosaic_gpu.flash_attention(q, k, v, q_offset=q_offset)

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
        text = jax.jit(fn).trace(q, kv, kv, offset).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text
    assert "stablehlo.pad" not in text


# GPU tier: the compiled Triton kernel at serving tiles.

gpu_only = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,dtype", [
    (32, 8, 128, jnp.bfloat16), (8, 8, 64, jnp.bfloat16), (16, 2, 128, jnp.float32), (8, 1, 64, jnp.float16)])
def test_gpu_causal(q_heads, kv_heads, head_dim, dtype):
    q, k, v = _inputs(6, 2, 1024, q_heads, kv_heads, head_dim, dtype)
    ref = reference(q, k, v)
    tolerance_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    _check(flash_attention(q, k, v), ref, tolerance_dtype)


@pytest.mark.gpu
@gpu_only
def test_gpu_seq_lens_and_padding():
    seq_lens = jnp.array([1000, 513, 1, 0], jnp.int32)
    q, k, v = _inputs(7, 4, 1000, 16, 4, 128, jnp.bfloat16)  # T = 1000 pads to 1024
    q, k, v = (_poison_past(x, seq_lens) for x in (q, k, v))
    out = flash_attention(q, k, v, seq_lens=seq_lens)
    clean = [jnp.nan_to_num(x) for x in (q, k, v)]
    _check(out, reference(*clean, seq_lens=seq_lens), jnp.bfloat16, seq_lens)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,dtype,tokens,config", [
    (32, 8, 128, jnp.bfloat16, 1024, None),
    (32, 8, 128, jnp.bfloat16, 1000, mosaic_gpu.MosaicAttentionConfig(num_stages=3)),
    (8, 2, 64, jnp.float16, 512, mosaic_gpu.MosaicAttentionConfig(block_kv=64, num_stages=4,
                                                                   pingpong=False)),
    (32, 8, 128, jnp.bfloat16, 1000, mosaic_gpu.MosaicAttentionConfig(pingpong=True)),
], ids=["gqa4_hd128", "pad_3stages", "hd64_f16_4stages_no_pingpong", "pingpong"])
def test_gpu_mosaic_causal(q_heads, kv_heads, head_dim, dtype, tokens, config):
    q, k, v = _inputs(10, 2, tokens, q_heads, kv_heads, head_dim, dtype)
    _check(mosaic_gpu.flash_attention(q, k, v, config=config), reference(q, k, v), jnp.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mosaic", [True, False], ids=["mosaic", "triton"])
@pytest.mark.parametrize("tokens,kv_tokens,offsets", [
    (1024, 4096, [0, 1500, 3072]),  # mid-tile offset; the last chunk of a 4096 prompt
    (1000, 4096, [77, 3500]),  # Tq padded; rows past the K/V end (padding: zeros)
], ids=["aligned", "padded"])
def test_gpu_offset(mosaic, tokens, kv_tokens, offsets):
    q, k, v = _inputs(16, len(offsets), tokens, 32, 8, 128, jnp.bfloat16, kv_tokens=kv_tokens)
    q_offset = jnp.array(offsets, jnp.int32)
    kernel = mosaic_gpu.flash_attention if mosaic else flash_attention
    config = None if mosaic else FlashAttentionConfig()  # a Triton config keeps the Triton kernel on Hopper
    out = kernel(q, k, v, q_offset=q_offset, config=config)
    _check(out, reference(q, k, v, q_offset=q_offset), jnp.bfloat16, jnp.full((len(offsets),), kv_tokens),
           q_offset)


@pytest.mark.gpu
@gpu_only
def test_gpu_dispatch_picks_mosaic_on_hopper():
    q, k, v = _inputs(11, 1, 256, 8, 2, 128, jnp.bfloat16)
    text = jax.jit(flash_attention).lower(q, k, v).as_text()
    assert ("mosaic_gpu" in text) == on_hopper()
    assert ("__gpu$xla.gpu.triton" in text) != on_hopper()
