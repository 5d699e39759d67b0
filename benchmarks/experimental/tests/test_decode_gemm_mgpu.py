"""benchmarks/experimental/decode_gemm/mosaic_gpu.py: the Mosaic GPU decode GEMM and the fused gate/up +
SwiGLU kernel (blocks of a persistent decode layer) in GPU interpret mode on the CPU, against a float32
product and the unfused ops, and their lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.experimental.decode_gemm.mosaic_gpu import GemvConfig, gate_up_swiglu, gemv, swiglu_reference


@pytest.mark.parametrize("rows,k,n,config", [(16, 512, 128, GemvConfig(128, 1, 2)),
                                             (16, 512, 128, GemvConfig(128, 2, 2)),
                                             (8, 256, 64, GemvConfig(64, 1, 3)),
                                             (16, 512, 128, GemvConfig(128, 1, 2, inplace=False))])
def test_gemv_matches_float32_product(rows, k, n, config):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    out = np.asarray(gemv(x, w, config, interpret=True))
    assert out.shape == (config.splits, n, rows)
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(out.sum(0).T, ref, rtol=1e-5, atol=1e-5)


def test_gemv_lowers_for_cuda_and_rejects_bad_shapes():
    x = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3072, 4096), jnp.bfloat16)
    text = jax.jit(functools.partial(gemv, config=GemvConfig(128, 2, 4))).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="multiple of 64"):
        gemv(jnp.zeros((16, 256), jnp.bfloat16), jnp.zeros((100, 256), jnp.bfloat16))


@pytest.mark.parametrize("rows,k,n,config", [(16, 512, 128, GemvConfig(128, 1, 2)), (8, 256, 64, GemvConfig(64, 1, 3))])
def test_gate_up_swiglu_matches_unfused_ops(rows, k, n, config):
    """The fused kernel is within one rounding of the model's unfused gate/up products and SwiGLU."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(2))
    out = gate_up_swiglu(x, w_gate, w_up, config, interpret=True)
    assert out.shape == (rows, n) and out.dtype == jnp.bfloat16
    ref = np.asarray(swiglu_reference(x, w_gate, w_up), np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("config", [GemvConfig(64, 1, 8), GemvConfig(128, 1, 4), GemvConfig(256, 1, 2)])
def test_gate_up_swiglu_lowers_at_the_8b_shape(config):
    x = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 7168), jnp.bfloat16)  # one device's gate (or up) at T=2
    fn = functools.partial(gate_up_swiglu, config=config)
    assert "mosaic_gpu" in jax.jit(fn).trace(x, w, w).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="at most 64"):
        gate_up_swiglu(jnp.zeros((128, 256), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16),
                       jnp.zeros((256, 64), jnp.bfloat16))
