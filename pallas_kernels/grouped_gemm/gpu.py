"""Grouped GEMM on Hopper (Mosaic GPU: TMA ring + wgmma), for MoE experts.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]
    out[r] = lhs[r] @ rhs[g]   for the rows r of group g; rows past sum(group_sizes) are zero.

Work: `metadata.group_tiles` cuts each non-empty group into row tiles of at most `block_m` rows that
start at the group's first row (plus the tail pseudo-group, stored as zeros). A work unit is one row
tile times `block_n` output features; units are numbered tile-major, so the CTAs working at the same
time stream neighbouring feature slices of the same expert. The kernel is persistent: `ctas` CTAs
stride over the `num_items * N / block_n` units, a count known only on the device, so empty experts
cost no CTA and no weight byte, and each touched expert's weights are read once per row tile.

Decode rows are few, so the expert weight is wgmma's A operand (`block_n` features, a multiple of 64)
and the tile's rows are its N operand (a multiple of 8). Each CTA has two warpgroups: the producer
TMA-loads the weight tile [block_k, block_n] (the transposed A operand, read in the experts' own
[K, N] layout) and the row tile [block_m, block_k] into a ring of `stages` SMEM slots, continuing
across units so the next unit's first tiles arrive during the current epilogue. The consumer
accumulates [block_n, block_m] in f32, leaving each wgmma in flight while the next slot is awaited,
writes the transposed tile to SMEM and stores the tile's rows with TMA stores of 2^i rows each (a
TMA store has a static shape; the row count is dynamic).

A row tile's load starts at min(start, M - block_m), so no load leaves the array; the store then
takes the tile's rows from that offset in SMEM. bf16 and f16 only (wgmma with a transposed A
operand; f32 would be tf32 with both operands K-major). sm_90a only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm import metadata

NUM_SMS = 132  # H100 / H200 SXM


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_m: int = 8     # rows per tile: wgmma's N, a multiple of 8, at most 256
    block_n: int = 64    # output features per unit: wgmma's M, a multiple of 64
    block_k: int = 128
    stages: int = 4
    ctas: int = NUM_SMS  # persistent CTAs


def default_config(m: int, k: int, n: int, num_groups: int) -> GpuConfig:
    """Row tiles sized so a typical group fits one tile (its weights then stream once): a group of r
    rows starting at r0 takes ceil((r0 % 8 + r) / block_m) tiles. Decode sizes stream 64-feature
    weight tiles with two CTAs per SM; prefill sizes take 128 x 128 tiles (compute-bound)."""
    mean_rows = m / max(1, num_groups)
    if mean_rows <= 2:
        cfg = GpuConfig(block_m=16, block_n=64, block_k=128, stages=6, ctas=2 * NUM_SMS)
    elif mean_rows <= 12:
        cfg = GpuConfig(block_m=32, block_n=64, block_k=128, stages=6, ctas=2 * NUM_SMS)
    elif mean_rows <= 40:
        cfg = GpuConfig(block_m=64, block_n=128, block_k=64, stages=4, ctas=NUM_SMS)
    else:
        cfg = GpuConfig(block_m=128, block_n=128, block_k=64, stages=4, ctas=NUM_SMS)
    # no tile taller than M (rounded down to 8): M needs no padding rows when it is a multiple of 8
    return dataclasses.replace(cfg, block_m=min(cfg.block_m, max(8, m // 8 * 8)))


def _swizzled(minor: int, dtype):
    """SMEM tiling + swizzle for a [rows, minor] wgmma operand (the widest swizzle that fits)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if (minor * itemsize) % s == 0)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _load_start(start, m: int, bm: int):
    """The first row of a tile's row load: its start rounded down to the SMEM tiling's 8 rows, at
    most m - bm (m and bm are multiples of 8), so the load stays inside lhs."""
    return pl.multiple_of(jnp.minimum(start - lax.rem(start, 8), m - bm), 8)


def _kernel(num_ref, group_ref, start_ref, rows_ref, lhs_ref, rhs_ref, out_ref,
            x_smem, w_smem, o_smem, x_ready, w_ready, free, *, cfg: GpuConfig, n_tiles: int,
            k_steps: int, num_groups: int):
    m = lhs_ref.shape[0]
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    cta = lax.axis_index("cta")
    units = num_ref[0] * n_tiles
    my_units = jnp.maximum(units - cta + cfg.ctas - 1, 0) // cfg.ctas

    def unit_info(i):
        u = cta + i * cfg.ctas
        item, n_tile = u // n_tiles, lax.rem(u, n_tiles)
        group = group_ref[item]
        steps = jnp.where(group < num_groups, k_steps, 0)
        return item, n_tile, group, steps

    @pl.when(lax.axis_index("wg") == 1)
    def _producer():
        def unit(i, issued):
            item, n_tile, group, steps = unit_info(i)
            load_start = _load_start(start_ref[item], m, bm)
            cols = pl.ds(n_tile * bn, bn)

            def step(kk, issued):
                slot = lax.rem(issued, stages)

                @pl.when(issued >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                ks = pl.ds(kk * bk, bk)
                plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(load_start, bm), ks], x_smem.at[slot],
                                        x_ready.at[slot])
                plgpu.copy_gmem_to_smem(rhs_ref.at[group, ks, cols], w_smem.at[slot], w_ready.at[slot])
                return issued + 1

            return lax.fori_loop(0, steps, step, issued)

        issued = lax.fori_loop(0, my_units, unit, jnp.int32(0))
        for slot in range(stages):  # observe each used slot's last release before the CTA exits
            @pl.when(issued > slot)
            def _():
                plgpu.barrier_wait(free.at[slot])

    @pl.when(lax.axis_index("wg") == 0)
    def _consumer():
        def unit(i, consumed):
            item, n_tile, group, steps = unit_info(i)
            start, rows = start_ref[item], rows_ref[item]
            offset = start - _load_start(start, m, bm)

            def accumulate(acc_ref):
                def step(kk, consumed):
                    slot = lax.rem(consumed, stages)
                    plgpu.barrier_wait(x_ready.at[slot])
                    plgpu.barrier_wait(w_ready.at[slot])
                    plgpu.wgmma(acc_ref, w_smem.at[slot].transpose((1, 0)),
                                x_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma_wait(1)  # the previous step's product is done: release its slot

                    @pl.when(kk > 0)
                    def _():
                        plgpu.barrier_arrive(free.at[lax.rem(consumed + stages - 1, stages)])
                    return consumed + 1

                done = lax.fori_loop(0, steps, step, consumed)
                plgpu.wgmma_wait(0)

                @pl.when(steps > 0)
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(done + stages - 1, stages)])
                return acc_ref[...], done

            acc, consumed = pl.run_scoped(accumulate, plgpu.ACC((bn, bm), jnp.float32))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's stores have read o_smem
            o_smem.transpose((1, 0))[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            cols = pl.ds(n_tile * bn, bn)
            stored = jnp.int32(0)
            size = bm
            while size:  # rows = sum of its binary digits: one static-shape store per set bit
                @pl.when((rows & size) != 0)
                def _(size=size, stored=stored):
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset + stored, size)],
                                            out_ref.at[pl.ds(start + stored, size), cols])
                stored = stored + (rows & size)
                size //= 2
            return consumed

        lax.fori_loop(0, my_units, unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check(lhs, rhs, group_sizes, cfg: GpuConfig):
    m, k = lhs.shape
    if rhs.ndim != 3 or rhs.shape[1] != k or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}: expected "
                         "lhs [M, K], rhs [G, K, N] and group_sizes [G]")
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"lhs {lhs.dtype} / rhs {rhs.dtype}: the Mosaic GPU grouped GEMM takes bf16 or f16 "
                         "operands of one dtype; use backend='reference' for others")
    n = rhs.shape[2]
    if cfg.block_m % 8 or not 8 <= cfg.block_m <= 256 or cfg.block_n % 64:
        raise ValueError(f"{cfg}: block_m must be a multiple of 8 in [8, 256], block_n a multiple of 64")
    if n % cfg.block_n or k % cfg.block_k:
        raise ValueError(f"K {k}, N {n}: N must be a multiple of block_n = {cfg.block_n} and K of "
                         f"block_k = {cfg.block_k}; pick a GpuConfig that divides them")


def grouped_matmul(lhs, rhs, group_sizes, config: GpuConfig | None = None, interpret: bool = False):
    """lhs [M, K] @ rhs[group] for each group's rows -> [M, N] in lhs.dtype (see the module doc)."""
    m, k = lhs.shape
    g, _, n = rhs.shape
    cfg = config or default_config(m, k, n, g)
    _check(lhs, rhs, group_sizes, cfg)
    # a row tile's load takes block_m rows from a multiple of 8: pad M up to that (the padded rows
    # join the tail pseudo-group and are sliced off)
    mp = max(-(-m // 8) * 8, cfg.block_m)
    pad = mp - m
    if pad:
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
    num, group, start, rows = metadata.group_tiles(group_sizes, mp, cfg.block_m)
    kernel = functools.partial(_kernel, cfg=cfg, n_tiles=n // cfg.block_n, k_steps=k // cfg.block_k,
                               num_groups=g)
    dtype = lhs.dtype
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((mp, n), dtype),
        scratch_types=(
            plgpu.SMEM((cfg.stages, cfg.block_m, cfg.block_k), dtype, transforms=_swizzled(cfg.block_k, dtype)),
            plgpu.SMEM((cfg.stages, cfg.block_k, cfg.block_n), dtype, transforms=_swizzled(cfg.block_n, dtype)),
            plgpu.SMEM((cfg.block_m, cfg.block_n), dtype),
            plgpu.Barrier(num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
        ),
        grid=(cfg.ctas,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(num, group, start, rows, lhs, rhs)
    return out[:m] if pad else out
