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


def test_w8a8_matches_a_numpy_reference_and_the_float_product():
    """W8A8 (the GPU's prefill path): rows quantized to fp8 per token, an fp8 x fp8 product in float32, both
    scales applied; against the same math in numpy, and within fp8's error of the dequantized product."""
    rng = np.random.default_rng(3)
    q, scale = _weight(rng, 256, 128)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    x[7] = 0.0  # a zero row keeps a finite scale
    x_scale = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-12) / 448
    xq = (x / x_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    expected = (xq @ q.astype(np.float64)) * x_scale * scale[None, :]
    got = np.asarray(quant.w8a8(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert not got[7].any()
    exact = x.astype(np.float64) @ (q.astype(np.float64) * scale)
    assert np.abs(got - exact).max() / np.abs(exact).max() < 0.05


def test_linear_runs_w8a8_for_prefill_sized_steps(monkeypatch):
    """(Eager calls: nothing jitted here outlives the patch.)"""
    rng = np.random.default_rng(4)
    w = quant.quantize(rng.standard_normal((256, 2, 64)).astype(np.float32), 1)
    w = quant.Fp8Weight(jnp.asarray(w.q), jnp.asarray(w.scale), w.block)
    x = jnp.asarray(rng.standard_normal((80, 256)), jnp.float32)
    plain = np.asarray(quant.linear(x, w, "td,dnh->tnh"))
    assert quant._fp8_tensor_cores(x, w, "td,dnh->tnh") is None  # not a GPU
    monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows: num_rows > gpu.MAX_ROWS)
    got = quant.linear(x, w, "td,dnh->tnh")
    assert got.shape == (80, 2, 64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(quant.w8a8(x, w.q.reshape(256, 128), w.scale.reshape(128)))
                               .reshape(80, 2, 64), rtol=1e-6)
    assert np.abs(np.asarray(got) - plain).max() / np.abs(plain).max() < 0.05
    assert quant._fp8_tensor_cores(x[:gpu.MAX_ROWS], w, "td,dnh->tnh") is None  # decode-sized: the kernel's
    assert quant._fp8_tensor_cores(x, w, "tnh,dnh->td") is None  # not x times w's leading axis
