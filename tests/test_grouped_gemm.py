"""pallas_kernels/grouped_gemm: the Mosaic GPU and TPU grouped GEMMs against `lax.ragged_dot`.

CPU tier: the work lists against a plain-Python model; the Mosaic GPU kernel in GPU interpret mode
(bf16) and the TPU kernel in interpret mode (f32, bf16; HLO interpreter and the TPU simulator) on
tiny shapes with empty groups, unaligned group sizes and rows past sum(group_sizes); the entry's
dispatch; cross-lowering for cuda and tpu at the Qwen3-30B-A3B expert shapes.
GPU tier (`-m gpu`): the compiled kernel on the device against ragged_dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_gemm import gpu, grouped_matmul, metadata, reference, tpu

# (m, k, n, group sizes): empty groups, unaligned sizes and starts, rows past the sum, M not a multiple of 8
CASES = [(40, 128, 128, [5, 0, 13, 1, 0, 9]), (37, 128, 64, [3, 11, 0, 17, 2]), (5, 64, 64, [1, 0, 2, 1])]


def _operands(case, dtype, seed):
    m, k, n, sizes = case
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _check(out, lhs, rhs, sizes, tol):
    truth = np.asarray(jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                                          precision=jax.lax.Precision.HIGHEST))
    if lhs.shape[0] <= 64:  # and the per-row ground truth where it is small
        np.testing.assert_allclose(np.asarray(reference.grouped_matmul_f32(lhs, rhs, sizes)), truth, atol=1e-5)
    out = np.asarray(out, np.float32)
    assert out.shape == truth.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    total = int(np.sum(np.asarray(sizes)))
    assert not out[total:].any(), "rows past sum(group_sizes) must be zero"
    err = np.linalg.norm(out - truth) / np.linalg.norm(truth)
    assert err < tol, err
    # and the same function as XLA's ragged_dot
    rd = np.asarray(reference.ragged_dot(lhs, rhs, sizes), np.float32)
    assert np.linalg.norm(out - rd) / np.linalg.norm(truth) < max(tol, 1e-5)


def test_work_lists_match_a_plain_model():
    rng = np.random.default_rng(0)
    group_tiles = jax.jit(metadata.group_tiles, static_argnums=(1, 2))
    aligned_tiles = jax.jit(metadata.aligned_tiles, static_argnums=(1, 2))
    for i in range(16):
        g, m, bm = 6, (61, 8)[i % 2], (8, 16)[i // 2 % 2]
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g).astype(np.int32)
        sizes[rng.random(g) < 0.3] = 0
        num, group, start, rows = (np.asarray(a) for a in group_tiles(jnp.asarray(sizes), m, bm))
        items = list(zip(group[:num[0]].tolist(), start[:num[0]].tolist(), rows[:num[0]].tolist()))
        assert items == metadata.group_tiles_numpy(sizes, m, bm)
        assert all(s - s % 8 + bm >= s + r for _, s, r in items)  # inside an aligned load window
        assert {gg for gg, _, _ in items} == {i for i in range(g + 1) if i == g or sizes[i]} - (
            set() if m > sizes.sum() else {g})  # empty groups own no item

        mp = -(-m // bm) * bm
        num, group, m_tile, bounds = (np.asarray(a) for a in aligned_tiles(jnp.asarray(sizes), mp, bm))
        covered = np.zeros(mp, int)
        for gg, t in zip(group[:num[0]], m_tile[:num[0]]):
            lo, hi = max(bounds[gg], t * bm), min(bounds[gg + 1], (t + 1) * bm)
            assert lo < hi
            covered[lo:hi] += 1
        assert (covered == 1).all() and (np.diff(m_tile[:num[0]]) >= 0).all()
        assert num[0] <= metadata.max_aligned_tiles(mp, g, bm)


@pytest.mark.parametrize("case,cfg", [
    (CASES[1], gpu.GpuConfig(block_m=16, block_n=64, block_k=64, stages=2, ctas=3)),
    (CASES[2], gpu.GpuConfig(block_m=8, block_n=64, block_k=64, stages=2, ctas=2)),
])
def test_mosaic_gpu_kernel_in_gpu_interpret_mode(case, cfg):
    lhs, rhs, sizes = _operands(case, jnp.bfloat16, 1)
    _check(gpu.grouped_matmul(lhs, rhs, sizes, cfg, interpret=True), lhs, rhs, sizes, 1e-2)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", CASES[:2])
def test_tpu_kernel_in_interpret_mode(case, dtype, tol):
    lhs, rhs, sizes = _operands(case, dtype, 2)
    cfg = tpu.TpuConfig(block_m=16, block_k=64, block_n=64)
    _check(tpu.grouped_matmul(lhs, rhs, sizes, cfg, interpret=True), lhs, rhs, sizes, tol)


def test_tpu_kernel_in_the_tpu_simulator():
    lhs, rhs, sizes = _operands(CASES[0], jnp.float32, 3)
    out = tpu.grouped_matmul(lhs, rhs, sizes, tpu.TpuConfig(16, 128, 128),
                             interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
    _check(out, lhs, rhs, sizes, 1e-5)


def test_entry_dispatch():
    lhs, rhs, sizes = _operands(CASES[1], jnp.float32, 4)
    ref = grouped_matmul(lhs, rhs, sizes, backend="reference")
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)))
    np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, rhs, sizes)), np.asarray(ref))  # auto on CPU
    out = grouped_matmul(lhs, rhs, sizes, backend="pallas", interpret=True, config=tpu.TpuConfig(16, 64, 64))
    _check(out, lhs, rhs, sizes, 1e-5)
    with pytest.raises(ValueError, match="backend='pallas' on platform 'cpu'"):
        grouped_matmul(lhs, rhs, sizes, backend="pallas")
    with pytest.raises(ValueError, match="expected one of"):
        grouped_matmul(lhs, rhs, sizes, backend="triton")
    with pytest.raises(ValueError, match="bf16 or f16"):
        grouped_matmul(lhs, rhs, sizes, backend="pallas", platform="gpu", interpret=True)
    with pytest.raises(ValueError, match="rhs \\[G, K, N\\]"):
        grouped_matmul(lhs, rhs[:, :8], sizes)


QWEN = [(8, 2048, 1536), (512, 768, 2048), (32768, 2048, 1536)]  # rows (T x top-8), K, N; 128 experts


def _structs(m, k, n, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((128, k, n), dtype),
            jax.ShapeDtypeStruct((128,), jnp.int32))


@pytest.mark.parametrize("m,k,n", QWEN)
def test_mosaic_gpu_kernel_lowers_for_cuda(m, k, n):
    gdev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gdev)):
        text = jax.jit(gpu.grouped_matmul).trace(*_structs(m, k, n)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("m,k,n", QWEN[:2])
def test_tpu_kernel_lowers_for_tpu(m, k, n):
    tdev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", platform="tpu", num_cores=1)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=tdev)):
        text = jax.jit(tpu.grouped_matmul).trace(*_structs(m, k, n)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("tokens,k,n", [(1, 2048, 1536), (3, 768, 2048), (64, 2048, 1536), (512, 768, 2048)])
def test_mosaic_gpu_kernel_on_the_device(tokens, k, n):
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(128, 8, replace=False) for _ in range(tokens)])
    sizes = jnp.asarray(np.bincount(ids.ravel(), minlength=128), jnp.int32)
    m = tokens * 8 + 5  # 5 rows past the sum
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.key(tokens), (128, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    out = jax.jit(functools.partial(grouped_matmul, backend="pallas"))(lhs, rhs, sizes)
    _check(out, lhs, rhs, sizes, 1e-2)
