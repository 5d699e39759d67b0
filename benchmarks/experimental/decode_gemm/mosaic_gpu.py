"""Decode-sized GEMMs on Hopper's TMA + wgmma (Mosaic GPU): the first blocks of a persistent decode
layer. M (the decode rows, a multiple of 8) is wgmma's N; the weight is its A operand, 64 output
features per CTA.

    gemv(x [M, K], w [N, K])                 -> float32 partial sums [splits, N, M] (transposed)
    gate_up_swiglu(x [M, K], w_gate, w_up [K, N]) -> silu(x @ w_gate) * (x @ w_up) [M, N], M <= 64

Both: grid (N / 64[, splits]), 2 warpgroups per CTA. The producer TMA-loads weight and x tiles into a
ring of `stages` SMEM slots and reloads a slot once the consumer has released it. The consumer
accumulates in f32 with each wgmma left in flight across the next step's wait (`GemvConfig.inplace`;
False: a fresh accumulator per step, added in registers) and releases a slot one step later.
`gate_up_swiglu` reads the engine's own [K, N] weights (each [BK, 64] tile is wgmma's A operand
transposed), keeps two accumulators and applies SwiGLU in its epilogue, rounded as the unfused ops
round (gate and up to the dtype first): XLA runs the gate/up GEMM and the product as two kernels.

`interpret=True` runs them in GPU interpret mode on a CPU (benchmarks/experimental/tests/test_decode_gemm_mgpu.py).
`benchmarks/decode_gemv_mgpu.py` times both against XLA's dot at the Llama-3-8B shapes; the figures
(and which kernels have run on a GPU) are in benchmarks/RESULTS.md.

NOTE: sm_90a only (wgmma). Not wired into the engine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE_N = 64  # wgmma's M: output features per CTA


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_k: int = 128
    splits: int = 1
    stages: int = 4
    inplace: bool = True  # one accumulator across K steps, each wgmma left in flight while the next
    #                       step's tiles are awaited; False: a fresh accumulator per step, added in registers


def _transforms(minor: int, dtype):
    """SMEM tiling + swizzle for a [rows, minor] wgmma operand (the widest swizzle that fits)."""
    row_bytes = minor * jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if row_bytes % s == 0)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _fill_ring(load, free, steps: int, stages: int):
    """The producer: `load(j, slot)` issues step j's TMA copies into `slot`; slot j % stages is refilled
    once the consumer has arrived on its `free` barrier (each arrival waited on exactly once)."""
    for j in range(min(stages, steps)):
        load(j, j)

    @pl.loop(stages, steps)
    def _(j):
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.barrier_wait(free.at[slot])
        load(j, slot)

    for slot in range(min(stages, steps)):  # every barrier phase is observed before the CTA exits
        plgpu.barrier_wait(free.at[slot])


def _drain_ring(issue, free, steps: int, stages: int, per_step: int):
    """The consumer's in-place loop: `issue(slot)` waits for the slot's tiles and issues `per_step`
    wgmmas into accumulators that live across steps. They stay in flight across the next step's
    wait; a slot is released once its products are done, one step later."""
    def step(j, carry):
        issue(lax.rem(j, jnp.int32(stages)))
        plgpu.wgmma_wait(per_step)  # step j - 1's products are done: its slot can be refilled

        @pl.when(j > 0)
        def _():
            plgpu.barrier_arrive(free.at[lax.rem(j + stages - 1, jnp.int32(stages))])
        return carry

    lax.fori_loop(0, steps, step, None)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(free.at[(steps - 1) % stages])


def _kernel(x_ref, w_ref, o_ref, x_smem, w_smem, out_smem, x_ready, w_ready, free, *, block_k: int,
            steps: int, stages: int, inplace: bool):
    rows = x_ref.shape[0]
    n_tile, split = lax.axis_index("n"), lax.axis_index("s")
    n_rows = pl.ds(n_tile * TILE_N, TILE_N)
    k_first = split * (steps * block_k)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _consumer():
        def step(j, acc):
            slot = lax.rem(j, jnp.int32(stages))
            plgpu.barrier_wait(x_ready.at[slot])
            plgpu.barrier_wait(w_ready.at[slot])

            def product(acc_ref):
                plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            part = pl.run_scoped(product, plgpu.ACC((TILE_N, rows), jnp.float32))
            plgpu.barrier_arrive(free.at[slot])
            return acc + part

        def accumulate(acc_ref):
            def issue(slot):
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[slot].transpose((1, 0)))

            _drain_ring(issue, free, steps, stages, per_step=1)
            return acc_ref[...]

        if inplace:
            acc = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, rows), jnp.float32))  # starts at zero
        else:
            acc = plgpu.layout_cast(jnp.zeros((TILE_N, rows), jnp.float32), plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, steps, step, acc)
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[split, n_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        def load(j, slot):
            ks = pl.ds(k_first + j * block_k, block_k)
            plgpu.copy_gmem_to_smem(x_ref.at[:, ks], x_smem.at[slot], x_ready.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[n_rows, ks], w_smem.at[slot], w_ready.at[slot])

        _fill_ring(load, free, steps, stages)


def _swiglu_kernel(x_ref, wg_ref, wu_ref, o_ref, x_smem, wg_smem, wu_smem, out_smem, x_ready, wg_ready,
                   wu_ready, free, *, block_k: int, steps: int, stages: int):
    """One CTA: h[:, 64 features] = silu(x @ w_gate[:, f]) * (x @ w_up[:, f]), weights [K, N] (the
    engine's layout: each [BK, 64] tile is wgmma's A operand transposed)."""
    rows = x_ref.shape[0]
    cols = pl.ds(lax.axis_index("n") * TILE_N, TILE_N)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _consumer():
        def accumulate(acc_g, acc_u):
            def issue(slot):
                x_t = x_smem.at[slot].transpose((1, 0))
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.barrier_wait(wg_ready.at[slot])
                plgpu.wgmma(acc_g, wg_smem.at[slot].transpose((1, 0)), x_t)
                plgpu.barrier_wait(wu_ready.at[slot])
                plgpu.wgmma(acc_u, wu_smem.at[slot].transpose((1, 0)), x_t)

            _drain_ring(issue, free, steps, stages, per_step=2)
            return acc_g[...], acc_u[...]

        gate, up = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, rows), jnp.float32),
                                 plgpu.ACC((TILE_N, rows), jnp.float32))
        # rounded as the unfused ops round them: gate and up to the dtype, then silu(gate) * up
        dtype = o_ref.dtype
        gate, up = gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32)
        h = gate / (1.0 + jnp.exp(-gate)) * up
        out_smem.transpose((1, 0))[...] = h.astype(dtype)  # [64, M] registers -> [M, 64] tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[:, cols])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        def load(j, slot):
            ks = pl.ds(j * block_k, block_k)
            plgpu.copy_gmem_to_smem(x_ref.at[:, ks], x_smem.at[slot], x_ready.at[slot])
            plgpu.copy_gmem_to_smem(wg_ref.at[ks, cols], wg_smem.at[slot], wg_ready.at[slot])
            plgpu.copy_gmem_to_smem(wu_ref.at[ks, cols], wu_smem.at[slot], wu_ready.at[slot])

        _fill_ring(load, free, steps, stages)


def gate_up_swiglu(x, w_gate, w_up, config: GemvConfig = GemvConfig(), interpret: bool = False):
    """silu(x @ w_gate) * (x @ w_up) for decode rows: x [M, K], w_gate and w_up [K, N] -> [M, N] in x's
    dtype, in one kernel (XLA runs the two products as one GEMM and the product of the two as another
    kernel). Only config.block_k and config.stages are used (no K splits: silu is not linear)."""
    rows, k = x.shape
    n = w_gate.shape[1]
    bk, stages = config.block_k, config.stages
    if w_gate.shape != (k, n) or w_up.shape != (k, n) or n % TILE_N or k % bk or rows % 8 or rows > 64:
        raise ValueError(f"x {x.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}: weights [K, N] alike, N a "
                         f"multiple of {TILE_N}, K of block_k = {bk}, M a multiple of 8 and at most 64")
    kernel = functools.partial(_swiglu_kernel, block_k=bk, steps=k // bk, stages=stages)
    w_smem = plgpu.SMEM((stages, bk, TILE_N), w_gate.dtype, transforms=_transforms(TILE_N, w_gate.dtype))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((rows, n), x.dtype),
        scratch_types=(
            plgpu.SMEM((stages, rows, bk), x.dtype, transforms=_transforms(bk, x.dtype)),
            w_smem, w_smem,
            plgpu.SMEM((rows, TILE_N), x.dtype, transforms=_transforms(TILE_N, x.dtype)),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ),
        grid=(n // TILE_N,),
        grid_names=("n",),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(x, w_gate, w_up)


def swiglu_reference(x, w_gate, w_up):
    """The unfused ops as the model runs them (layers.gated_mlp before its down projection)."""
    gate = jnp.einsum("td,df->tf", x, w_gate)
    up = jnp.einsum("td,df->tf", x, w_up)
    return jax.nn.silu(gate) * up


def gemv(x, w, config: GemvConfig = GemvConfig(), interpret: bool = False):
    """x [M, K] @ w[N, K].T -> float32 partial sums [splits, N, M] (transposed)."""
    rows, k = x.shape
    n = w.shape[0]
    bk, splits, stages = config.block_k, config.splits, config.stages
    if n % TILE_N or k % (splits * bk) or rows % 8 or w.shape[1] != k:
        raise ValueError(f"x {x.shape} / w {w.shape}: N must be a multiple of {TILE_N}, K of splits x "
                         f"block_k = {splits * bk}, M of 8")
    steps = k // (splits * bk)
    kernel = functools.partial(_kernel, block_k=bk, steps=steps, stages=stages, inplace=config.inplace)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
        scratch_types=(
            plgpu.SMEM((stages, rows, bk), x.dtype, transforms=_transforms(bk, x.dtype)),
            plgpu.SMEM((stages, TILE_N, bk), w.dtype, transforms=_transforms(bk, w.dtype)),
            plgpu.SMEM((TILE_N, rows), jnp.float32),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ),
        grid=(n // TILE_N, splits),
        grid_names=("n", "s"),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(x, w)
