"""The FP8 GEMM kernel (pallas_kernels/fp8_gemm/gpu.py) in interpret mode against a numpy reference, with
and without split-K; its CUDA lowering; and quant.linear's choice of it (the model's matmul sites)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models import quant
from pallas_kernels.fp8_gemm import gpu

SMALL = gpu.TuningConfig(num_cores=4)  # few cores: split-K at these small shapes too


def _weight(rng, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((k, n)).astype(np.float32)
    scale = np.abs(w).max(0) / 448
    return (w / scale).astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


@pytest.mark.parametrize("m,k,n", [(1, 512, 128), (5, 1024, 64), (16, 256, 256), (33, 512, 192)])
def test_kernel_matches_dequantized_reference(m, k, n):
    rng = np.random.default_rng(m)
    q, scale = _weight(rng, k, n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    expected = x.astype(np.float64) @ (q.astype(np.float64) * scale)
    out = gpu.fp8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), config=SMALL, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-3)


def test_split_policy_and_refusals():
    config = gpu.TuningConfig()
    assert gpu.num_splits(config, 4096, 14336) == 2 and gpu.num_splits(config, 4096, 1024) == 16
    assert 4096 // config.block_k % gpu.num_splits(config, 4096, 4096) == 0
    assert not gpu.supported(65, 4096, 4096) and not gpu.supported(1, 4000, 4096)
    with pytest.raises(ValueError, match="fp8_matmul takes"):
        gpu.fp8_matmul(jnp.zeros((1, 100)), jnp.zeros((100, 64), gpu.FP8), jnp.ones(64), interpret=True)


def test_lowers_for_cuda():
    gdev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    args = (jax.ShapeDtypeStruct((4, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 1024), gpu.FP8),
            jax.ShapeDtypeStruct((1024,), jnp.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend warns
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gdev)):
            text = jax.jit(gpu.fp8_matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("subscripts,shape,n_in", [("td,dnh->tnh", (512, 2, 64), 1), (None, (256, 128), 1),
                                                    ("tf,fd->td", (256, 64), 1)])
def test_linear_runs_the_kernel_where_it_applies(subscripts, shape, n_in):
    rng = np.random.default_rng(0)
    w = quant.quantize(rng.standard_normal(shape).astype(np.float32), n_in)
    w = quant.Fp8Weight(jnp.asarray(w.q), jnp.asarray(w.scale), w.block)
    x = jnp.asarray(rng.standard_normal((3, shape[0])), jnp.float32)
    assert quant._fp8_kernel(x, w, subscripts, True) is not None
    kernel = quant.linear(x, w, subscripts, kernel=True)
    plain = quant.linear(x, w, subscripts, kernel=False)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(plain), rtol=1e-4, atol=1e-3)
    # Not a GPU and not forced; a prefill-sized step; block scales: dequantized instead.
    assert quant._fp8_kernel(x, w, subscripts, None) is None
    assert quant._fp8_kernel(jnp.zeros((gpu.MAX_ROWS + 1, shape[0])), w, subscripts, True) is None
    blocked = quant.Fp8Weight(w.q, jnp.ones((shape[0] // 128, *shape[1:]), jnp.float32), (128, *(1,) * (len(shape) - 1)))
    assert quant._fp8_kernel(x, blocked, subscripts, True) is None
