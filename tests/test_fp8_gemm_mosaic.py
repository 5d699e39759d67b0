"""pallas_kernels/fp8_gemm/mosaic_gpu.py: the W8A8 fp8 decode GEMM (TMA + fp8 wgmma) a single-device engine
runs for decode steps (models/quant.py).

CPU tier: GPU interpret mode at tiny shapes against a numpy reference of the same W8A8 math (x quantized
per row to float8_e4m3fn, both operands dequantized, an f32 product), a looser check against the
unquantized product, the activation quantization itself, the engine's tuning choice, and the lowering for
CUDA at Llama-3-8B decode shapes with that tuning (the fp8 x fp8 wgmma instruction in the module). GPU tier
(`-m gpu`): the compiled kernel at those shapes against the same reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8_gemm.mosaic_gpu import (
    FP8, Fp8GemvConfig, choose_config, fp8_gemv, fp8_gemv_quantized, padded_rows, quantize_rows)

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles")


def _weights(rng, n, k):
    """A random weight [N, K] quantized per output feature: (original f32, q fp8, w_scale [N] f32)."""
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w_scale = np.abs(w).max(axis=1) / 448.0
    q = (w / w_scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    return w, q, w_scale.astype(np.float32)


def _w8a8_reference(x, q, w_scale):
    """numpy: x quantized per row (x * (448 / max|row|) rounded to fp8, scale max|row| / 448; a zero row
    quantizes to zeros), both sides dequantized, f32."""
    x32 = np.asarray(x, np.float32)
    amax = np.abs(x32).max(axis=1)
    safe = np.where(amax > 0, amax, np.float32(448.0)).astype(np.float32)
    x_scale = safe / np.float32(448.0)
    xq = np.clip(x32 * (np.float32(448.0) / safe)[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    xd = xq.astype(np.float32) * x_scale[:, None]
    return xd @ (q.astype(np.float32) * w_scale[:, None]).T


def _x(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, ::37] *= 8.0  # a few outlier channels, as real activations have
    return jnp.asarray(x, jnp.bfloat16)


def _assert_close(out, ref):
    out = np.asarray(out, np.float32)
    assert out.shape == ref.shape and not np.isnan(out).any()
    # the kernel's result is the reference rounded to bf16 (f32 sums in another order aside)
    np.testing.assert_allclose(out, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("m,k,n,config", [
    (1, 256, 128, Fp8GemvConfig(block_k=128, stages=3)),
    (5, 512, 64, Fp8GemvConfig(block_k=128, stages=2, splits=2)),
], ids=["rows1", "rows5_splits2"])
def test_matches_w8a8_reference(m, k, n, config):
    rng = np.random.default_rng(m)
    x = _x(rng, m, k)
    _, q, w_scale = _weights(rng, n, k)
    out = fp8_gemv(x, jnp.asarray(q), jnp.asarray(w_scale), config=config, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    _assert_close(out, _w8a8_reference(x, q, w_scale))


def test_close_to_the_unquantized_product_and_zero_rows():
    """W8A8 against x @ w.T with the original weights: a few percent (relative L2); an all-zero row
    gives zeros."""
    rng = np.random.default_rng(3)
    m, k, n = 16, 512, 128
    x = np.asarray(_x(rng, m, k), np.float32)
    x[3] = 0.0
    w, q, w_scale = _weights(rng, n, k)
    out = np.asarray(fp8_gemv(jnp.asarray(x, jnp.bfloat16), jnp.asarray(q), jnp.asarray(w_scale),
                              config=Fp8GemvConfig(block_k=256, stages=2), interpret=True), np.float32)
    exact = x @ w.T
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert rel < 0.05, f"relative L2 error {rel:.3f} against the unquantized product"
    assert (out[3] == 0).all()


def test_quantize_rows():
    x = jnp.asarray([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [3e-3, 1e-3, -7e-3]], jnp.bfloat16)
    xq, scale = quantize_rows(x)
    assert xq.shape == (8, 3) and xq.dtype == FP8 and scale.shape == (8,)
    xq, scale = np.asarray(xq, np.float32), np.asarray(scale)
    assert xq[0, 1] == -448.0 and xq[2, 2] == -448.0  # each row's largest magnitude maps to fp8's max
    assert (xq[1] == 0).all() and scale[1] == 1.0  # a zero row: no division by zero
    assert (xq[3:] == 0).all() and (scale[3:] == 1.0).all()  # the padding rows
    np.testing.assert_allclose(xq[:3] * scale[:3, None], np.asarray(x, np.float32), rtol=2 ** -4)
    assert [padded_rows(m) for m in (1, 8, 9, 64)] == [8, 8, 16, 64]


def test_choose_config():
    """The engine's tuning: block_k 256 and 4 stages, K split until the N / 64 CTAs about fill 132 SMs
    (dividing K's blocks); None where the kernel does not take the shape."""
    assert choose_config(1, 4096, 28672) == Fp8GemvConfig(block_k=256, stages=4, splits=1)  # gate_up: 448 CTAs
    assert choose_config(64, 14336, 4096) == Fp8GemvConfig(block_k=256, stages=4, splits=4)  # down: 56 blocks
    assert choose_config(1, 4096, 1024).splits == 16  # wk, wv: 16 CTAs per split
    assert choose_config(3, 384, 128) == Fp8GemvConfig(block_k=128, stages=4, splits=3)
    assert choose_config(1, 4096, 100) is None and choose_config(1, 4000, 128) is None
    assert choose_config(0, 256, 128) is None and choose_config(257, 256, 128) is None
    assert choose_config(256, 4096, 4096) is None  # 256 rows at block_k 256: past the SMEM


@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (64, 14336, 4096)])
def test_lowers_for_cuda_with_fp8_wgmma(m, k, n):
    config = choose_config(m, k, n)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((n, k), FP8)
    s = jax.ShapeDtypeStruct((n,), jnp.float32)
    text = jax.jit(functools.partial(fp8_gemv, config=config)).trace(x, q, s).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert f"wgmma.mma_async.sync.aligned.m64n{padded_rows(m)}k32.f32.e4m3.e4m3" in text


def test_rejects_bad_shapes_and_configs():
    q = jnp.zeros((128, 512), FP8)
    s = jnp.ones((128,), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 64"):
        fp8_gemv(jnp.zeros((1, 512), jnp.bfloat16), q[:100], s[:100])
    with pytest.raises(ValueError, match="splits x block_k"):
        fp8_gemv(jnp.zeros((1, 512), jnp.bfloat16), q, s, config=Fp8GemvConfig(block_k=256, splits=4))
    with pytest.raises(ValueError, match="SMEM"):
        fp8_gemv(jnp.zeros((64, 512), jnp.bfloat16), q, s, config=Fp8GemvConfig(block_k=512, stages=4))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv_quantized(jnp.zeros((8, 512), jnp.bfloat16), jnp.ones((8,)), q, s)


# GPU tier: the compiled kernel at the Llama-3-8B decode shapes.

gpu_only = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("m,k,n,config", [
    (1, 4096, 6144, Fp8GemvConfig()),
    (16, 4096, 4096, Fp8GemvConfig(block_k=128, stages=6, splits=2)),
    (64, 14336, 4096, choose_config(64, 14336, 4096)),
    (13, 4096, 28672, Fp8GemvConfig(block_k=128, stages=4)),
    (1, 4096, 1024, choose_config(1, 4096, 1024)),
])
def test_gpu_matches_w8a8_reference(m, k, n, config):
    rng = np.random.default_rng(m)
    x = _x(rng, m, k)
    _, q, w_scale = _weights(rng, n, k)
    out = np.asarray(fp8_gemv(x, jnp.asarray(q), jnp.asarray(w_scale), config=config), np.float32)
    ref = _w8a8_reference(x, q, w_scale)
    assert out.shape == ref.shape and not np.isnan(out).any()
    # Hopper's fp8 wgmma sums with fewer mantissa bits than f32 (up to ~2% on one element at K 4096):
    # a looser bound than interpret mode's, still far below a misplaced tile or a missing scale
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, f"relative L2 error {rel:.2e}"
