"""benchmarks/decode_gemv_mgpu.py: the Mosaic GPU decode GEMM (the first block of a persistent decode
layer) in GPU interpret mode on the CPU against a float32 product, and its lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.decode_gemv_mgpu import GemvConfig, gemv


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
