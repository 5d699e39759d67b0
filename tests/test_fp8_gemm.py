"""The weight-only FP8 GEMM kernel (pallas_kernels/fp8_gemm/gpu.py) in interpret mode against a numpy
reference, with and without split-K; its CUDA lowering; W8A8 (quant.w8a8); and quant.linear's paths at the
model's matmul sites, for weights in their own layout and held [N, K] (quant.hold_transposed: the same
outputs dequantized, as W8A8, and through the Mosaic GPU decode kernel)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models import quant
from pallas_kernels.fp8_gemm import gpu, mosaic_gpu

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
    assert quant._fp8_kernel(jnp.zeros((quant.DECODE_ROWS + 1, shape[0])), w, subscripts, True) is None
    blocked = quant.Fp8Weight(w.q, jnp.ones((shape[0] // 128, *shape[1:]), jnp.float32), (128, *(1,) * (len(shape) - 1)))
    assert quant._fp8_kernel(x, blocked, subscripts, True) is None


def test_w8a8_matches_a_numpy_reference_and_the_float_product():
    """W8A8 (the GPU's prefill path): rows quantized to fp8 per token, an fp8 x fp8 product in float32, both
    scales applied; against the same math in numpy, and within fp8's error of the dequantized product."""
    rng = np.random.default_rng(3)
    q, scale = _weight(rng, 256, 128)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    x[7] = 0.0  # a zero row keeps a finite scale
    amax = np.abs(x).max(-1, keepdims=True)
    x_scale = np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32)
    multiplier = np.where(amax > 0, np.float32(448) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    xq = (x * multiplier).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
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
    monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows, _w: num_rows > quant.DECODE_ROWS)
    got = quant.linear(x, w, "td,dnh->tnh")
    assert got.shape == (80, 2, 64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(quant.w8a8(x, w.q.reshape(256, 128), w.scale.reshape(128)))
                               .reshape(80, 2, 64), rtol=1e-6)
    assert np.abs(np.asarray(got) - plain).max() / np.abs(plain).max() < 0.05
    assert quant._fp8_tensor_cores(x[:quant.DECODE_ROWS], w, "td,dnh->tnh") is None  # decode-sized: the kernel's
    assert quant._fp8_tensor_cores(x, w, "tnh,dnh->td") is None  # not x times w's leading axis


# FP8 weights held [N, K] (a single-device engine on a Hopper GPU): the same outputs on every path.

SITES = [("td,dnh->tnh", (256, 2, 64), 1, 0), (None, (2, 128, 128), 2, 2), ("tf,fd->td", (384, 128), 1, 0)]
SITE_IDS = ["wq", "wo_merged", "w_down"]


def _held_pair(subscripts, shape, n_in, merge):
    """(the weight in its own layout, the same held [N, K]), as the model's matmul site sees them (wo merged
    to [N*H, D] first)."""
    rng = np.random.default_rng(len(shape) + shape[0])
    w = quant.quantize(rng.standard_normal(shape).astype(np.float32), n_in)
    w = quant.Fp8Weight(jnp.asarray(w.q), jnp.asarray(w.scale), w.block)
    held = quant.hold_transposed(w)
    k = int(np.prod(shape[:n_in]))
    assert held.transposed and held.shape == shape and held.q.shape == (w.q.size // k, k)
    np.testing.assert_array_equal(np.asarray(held.q, np.float32), np.asarray(w.q, np.float32).reshape(k, -1).T)
    if merge:
        w, held = quant.merge_leading(w, merge), quant.merge_leading(held, merge)
        assert held.q.shape == (w.shape[1], w.shape[0]) and held.shape == w.shape and held.block == w.block
    return w, held


@pytest.mark.parametrize("subscripts,shape,n_in,merge", SITES, ids=SITE_IDS)
def test_held_transposed_dequantizes_to_the_same_outputs(subscripts, shape, n_in, merge):
    w, held = _held_pair(subscripts, shape, n_in, merge)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(held, jnp.float32)),
                                  np.asarray(quant.dequantize(w, jnp.float32)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, w.shape[0])), jnp.float32)
    np.testing.assert_array_equal(np.asarray(quant.linear(x, held, subscripts)),
                                  np.asarray(quant.linear(x, w, subscripts)))
    assert quant.tensor_cores_apply(5, held) is False  # not a GPU: dequantized
    # the layout is static pytree data: it survives tree maps and a jit boundary (where XLA may contract the
    # transposed weight in another order: float32 rounding apart, the same)
    assert jax.tree.map(lambda a: a, held).transposed_shape == held.shape
    jitted = jax.jit(quant.linear, static_argnums=2)
    np.testing.assert_allclose(np.asarray(jitted(x, held, subscripts)), np.asarray(jitted(x, w, subscripts)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subscripts,shape,n_in,merge", SITES, ids=SITE_IDS)
def test_held_transposed_w8a8_gives_the_same_outputs(subscripts, shape, n_in, merge, monkeypatch):
    """(Eager calls: nothing jitted here outlives the patch.)"""
    w, held = _held_pair(subscripts, shape, n_in, merge)
    monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows, _w: True)
    for rows in (3, 80):  # decode- and prefill-sized
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, w.shape[0])), jnp.bfloat16)
        got, want = quant.linear(x, held, subscripts), quant.linear(x, w, subscripts)
        assert got.shape == want.shape == (rows, *w.shape[1:]) and got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -8, atol=1e-6)


def test_block_scaled_weights_keep_their_layout():
    q = jnp.zeros((256, 128), quant.FP8_DTYPE)
    blocked = quant.Fp8Weight(q, jnp.ones((2, 128), jnp.float32), (128, 1))
    assert quant.hold_transposed(blocked) is blocked
    held = quant.hold_transposed(quant.Fp8Weight(q, jnp.ones((1, 128), jnp.float32), (256, 1)))
    assert quant.hold_transposed(held) is held and quant.hold_transposed(q) is q


def test_held_transposed_runs_the_mosaic_kernel_at_decode(monkeypatch):
    """A decode-sized bfloat16 step with a weight held [N, K]: the W8A8 Mosaic GPU kernel (interpret mode),
    the same math as W8A8 on the weight in its own layout. Where the kernel does not take the step (float32
    rows, too many rows, K off 128), none runs, and on a GPU W8A8 takes it (tensor_cores_apply)."""
    w, held = _held_pair("td,dnh->tnh", (256, 2, 64), 1, 0)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((5, 256)), jnp.bfloat16)
    assert quant._fp8_kernel(x, held, "td,dnh->tnh", None) is None  # not a GPU
    configs, fp8_gemv = [], mosaic_gpu.fp8_gemv
    monkeypatch.setattr(mosaic_gpu, "fp8_gemv",
                        lambda *args, **kw: configs.append(kw["config"]) or fp8_gemv(*args, **kw))
    got = quant.linear(x, held, "td,dnh->tnh", kernel=True)
    assert configs == [mosaic_gpu.choose_config(5, 256, 128)]
    monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows, _w: True)
    want = quant.linear(x, w, "td,dnh->tnh")
    assert got.shape == (5, 2, 64) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7,
                               atol=1e-2 * np.abs(np.asarray(want, np.float32)).max())
    assert quant._fp8_kernel(x.astype(jnp.float32), held, "td,dnh->tnh", True) is None
    assert quant._fp8_kernel(jnp.zeros((quant.DECODE_ROWS + 1, 256), jnp.bfloat16), held, "td,dnh->tnh", True) is None
    _, narrow = _held_pair("td,dnh->tnh", (64, 2, 64), 1, 0)
    assert quant._fp8_kernel(x[:, :64], narrow, "td,dnh->tnh", True) is None


def test_joined_weights_give_each_weights_product(monkeypatch):
    """wq, wk, wv held [N, K] and joined (quant.fuse_outputs, what device_setup.FUSED_FP8 does to a layer):
    x @ the joined weight, split, is each weight's own product, dequantized (a CPU's path), through the
    Mosaic kernel (interpret mode) and through W8A8; weights not held so, or over other inputs, are not
    joined."""
    parts = [_held_pair("td,dnh->tnh", (256, heads, 64), 1, 0) for heads in (4, 1, 1)]
    joined = quant.fuse_outputs([held for _, held in parts])
    assert joined.transposed and joined.shape == (256, 384) and joined.q.shape == (384, 256)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 256)), jnp.bfloat16)
    for options in ({}, {"kernel": True}):
        got = jnp.split(quant.linear(x, joined, **options), (256, 320), axis=-1)
        for (_, held), part in zip(parts, got):
            want = quant.linear(x, held, "td,dnh->tnh", **options).reshape(5, -1)
            np.testing.assert_array_equal(np.asarray(part, np.float32), np.asarray(want, np.float32))
    monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows, _w: True)
    got = jnp.split(quant.linear(x, joined), (256, 320), axis=-1)
    for (w, _), part in zip(parts, got):
        want = quant.linear(x, w, "td,dnh->tnh").reshape(5, -1)
        np.testing.assert_allclose(np.asarray(part, np.float32), np.asarray(want, np.float32), rtol=2 ** -7,
                                   atol=1e-2 * np.abs(np.asarray(want, np.float32)).max())
    assert quant.fuse_outputs([parts[0][0], parts[1][1]]) is None  # (one not held [N, K])
    _, other = _held_pair("td,dnh->tnh", (128, 1, 64), 1, 0)
    assert quant.fuse_outputs([parts[0][1], other]) is None  # (another K)


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic_gpu.runs_on(jax.devices()[0]), reason="needs a Hopper GPU")
def test_gpu_linear_on_held_weights():
    """On a Hopper GPU, jitted: a decode step through the Mosaic kernel, a prefill step through W8A8 on
    q [N, K], both within fp8's error of the dequantized product (Llama-3-8B's wk shape, K 4096, N 1024)."""
    w, held = _held_pair("td,dnh->tnh", (4096, 8, 128), 1, 0)
    linear = jax.jit(quant.linear, static_argnums=2)
    for rows in (4, 80):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 4096)), jnp.bfloat16)
        text = linear.lower(x, held, "td,dnh->tnh").as_text()
        assert ("mosaic_gpu" in text) == (rows <= quant.DECODE_ROWS)
        got = np.asarray(linear(x, held, "td,dnh->tnh"), np.float32)
        want = np.asarray(x, np.float32) @ np.asarray(quant.dequantize(w, jnp.float32)).reshape(4096, -1)
        rel = np.linalg.norm(got.reshape(rows, -1) - want) / np.linalg.norm(want)
        assert rel < 5e-2, f"rows {rows}: relative L2 error {rel:.2e}"
