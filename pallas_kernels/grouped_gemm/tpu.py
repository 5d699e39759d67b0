"""Grouped GEMM for TPU (megablox-style Pallas TPU kernel), for MoE experts.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]
    out[r] = lhs[r] @ rhs[g]   for the rows r of group g; rows past sum(group_sizes) are zero.

Grid (N / tn, num_items, K / tk), `num_items` traced: the work list (`metadata.aligned_tiles`,
scalar-prefetched into SMEM) names, for each middle grid step, a row tile of the fixed tm-row grid
and the one group it serves. Empty groups own no step, so their weights are never fetched; at decode
(every group inside one row tile) each touched expert's [K, N] weights stream through VMEM once per N
tile. A row tile shared by several groups is visited in consecutive steps, its output block stays in
VMEM between them, and each visit stores only its own group's rows (a row mask). The rows past the
sum are the work list's pseudo-group G: their steps skip the product and store zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_gemm import metadata


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    block_m: int = 128  # rows per tile (a multiple of 8; 16 for bf16 packing)
    block_k: int = 512
    block_n: int = 512


def default_config(m: int, k: int, n: int, dtype) -> TpuConfig:
    """The largest of the usual tile sizes that divide K and N (else the whole dimension); row tiles
    of at most 128 rows, fewer when M is small."""
    def fit(dim, options):
        return next((t for t in options if dim % t == 0), dim)

    sublanes = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    bm = min(128, -(-m // sublanes) * sublanes)
    return TpuConfig(block_m=bm, block_k=fit(k, (512, 256, 128)), block_n=fit(n, (512, 256, 128)))


def _kernel(num_ref, group_ref, tile_ref, bounds_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
            num_groups: int, k_steps: int, block_m: int):
    del num_ref
    item, kk = pl.program_id(1), pl.program_id(2)
    group = group_ref[item]

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(group < num_groups)
    def _():
        acc_ref[...] += jnp.dot(lhs_ref[...], rhs_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kk == k_steps - 1)
    def _():
        row = tile_ref[item] * block_m + lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (row >= bounds_ref[group]) & (row < bounds_ref[group + 1])
        out_ref[...] = jnp.where(mine, acc_ref[...], out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def grouped_matmul(lhs, rhs, group_sizes, config: TpuConfig | None = None, interpret=False):
    """lhs [M, K] @ rhs[group] for each group's rows -> [M, N] in lhs.dtype (see the module doc).
    `interpret`: False, True (the HLO interpreter) or a `pltpu.InterpretParams`."""
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if rhs.ndim != 3 or k2 != k or group_sizes.shape != (g,):
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}: expected "
                         "lhs [M, K], rhs [G, K, N] and group_sizes [G]")
    cfg = config or default_config(m, k, n, lhs.dtype)
    if k % cfg.block_k or n % cfg.block_n or cfg.block_m % 8:
        raise ValueError(f"K {k}, N {n}, {cfg}: block_k must divide K, block_n divide N and block_m be a "
                         "multiple of 8")
    bm, bk, bn = cfg.block_m, cfg.block_k, cfg.block_n
    mp = -(-m // bm) * bm  # padded rows join the tail pseudo-group and are sliced off
    if mp != m:
        lhs = jnp.pad(lhs, ((0, mp - m), (0, 0)))
    num, group, m_tile, bounds = metadata.aligned_tiles(group_sizes, mp, bm)
    k_steps = k // bk

    def lhs_map(nn, i, kk, num, group, m_tile, bounds):
        return m_tile[i], kk

    def rhs_map(nn, i, kk, num, group, m_tile, bounds):
        return jnp.minimum(group[i], g - 1), kk, nn  # the pseudo-group's steps fetch a block unused

    def out_map(nn, i, kk, num, group, m_tile, bounds):
        return m_tile[i], nn

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n // bn, num[0], k_steps),
        in_specs=[pl.BlockSpec((bm, bk), lhs_map), pl.BlockSpec((None, bk, bn), rhs_map)],
        out_specs=pl.BlockSpec((bm, bn), out_map),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, num_groups=g, k_steps=k_steps, block_m=bm),
        out_shape=jax.ShapeDtypeStruct((mp, n), lhs.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(num, group, m_tile, bounds, lhs, rhs)
    return out[:m] if mp != m else out
