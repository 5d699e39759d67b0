"""A decode GEMM on Hopper's TMA + wgmma (Mosaic GPU) against XLA's dot, for the per-device shapes of the
Llama-3-8B decode step: is the first block of a persistent decode-layer kernel as fast as XLA's GEMMs?

    python3 benchmarks/decode_gemv_mgpu.py [--rows 16] [--tp 2]        (H100/H200)
    python3 benchmarks/decode_gemv_mgpu.py --swiglu [--tp 1 2]          (gate_up_swiglu against XLA)
    python3 benchmarks/decode_gemv_mgpu.py --check                      (CPU: GPU interpret mode)

The kernel computes y = x @ w.T for x [M, K] (M = decode rows, 8..256) and w [N, K] (the weight stored
output-major, as checkpoints store it) with the operands swapped, so that the weight is wgmma's A
operand (M = 64 output features per tile) and the few decode rows are its N:

    grid (N / 64, splits), 2 warpgroups per CTA:
      producer: TMA-loads w[n tile, k step] [64, BK] and x[:, k step] [M, BK] into a ring of `stages`
        SMEM slots; a slot is reloaded once the consumer has released it
      consumer: acc [64, M] f32 += w tile @ x tile^T (wgmma, both from SMEM) per k step
      out [splits, N, M] float32: each split's partial sums, transposed (the consumer of a split
        GEMM, e.g. an all-reduce kernel, sums them as it reads)

`gate_up_swiglu` is the same pipeline with two weights [K, N] in the engine's own layout (each [BK, 64]
tile is wgmma's A operand transposed) and two accumulators, and SwiGLU in the epilogue: h [M, N] in
one kernel, where XLA runs the gate/up GEMM and then the product as another kernel. GPU interpret
mode and CUDA lowering pass for it; it has not run on a GPU yet.

Timing as in `decode_gemm.py` (~1 GB of weight copies, 10 calls queued back to back): the per-GEMM time
including launch gaps, as a decode step pays it. XLA's dot includes its split-K sum; the kernel's
partial sums are not summed (say so when comparing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
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
            def step_inplace(j, carry):
                slot = lax.rem(j, jnp.int32(stages))
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(1)  # step j - 1's product is done: its slot can be refilled

                @pl.when(j > 0)
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(j + stages - 1, jnp.int32(stages))])
                return carry

            lax.fori_loop(0, steps, step_inplace, None)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(free.at[(steps - 1) % stages])
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

        for j in range(min(stages, steps)):
            load(j, j)

        @pl.loop(stages, steps)
        def _(j):
            slot = lax.rem(j, jnp.int32(stages))
            plgpu.barrier_wait(free.at[slot])
            load(j, slot)

        for slot in range(min(stages, steps)):  # every barrier phase is observed before the CTA exits
            plgpu.barrier_wait(free.at[slot])


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
            def step(j, carry):
                slot = lax.rem(j, jnp.int32(stages))
                x_t = x_smem.at[slot].transpose((1, 0))
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.barrier_wait(wg_ready.at[slot])
                plgpu.wgmma(acc_g, wg_smem.at[slot].transpose((1, 0)), x_t)
                plgpu.barrier_wait(wu_ready.at[slot])
                plgpu.wgmma(acc_u, wu_smem.at[slot].transpose((1, 0)), x_t)
                plgpu.wgmma_wait(2)  # step j - 1's two products are done: its slot can be refilled

                @pl.when(j > 0)
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(j + stages - 1, jnp.int32(stages))])
                return carry

            lax.fori_loop(0, steps, step, None)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(free.at[(steps - 1) % stages])
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

        for j in range(min(stages, steps)):
            load(j, j)

        @pl.loop(stages, steps)
        def _(j):
            slot = lax.rem(j, jnp.int32(stages))
            plgpu.barrier_wait(free.at[slot])
            load(j, slot)

        for slot in range(min(stages, steps)):  # every barrier phase is observed before the CTA exits
            plgpu.barrier_wait(free.at[slot])


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


def check() -> None:
    """The kernels in GPU interpret mode (CPU) against a float32 product (gemv) and the unfused ops
    (gate_up_swiglu, within one rounding of the dtype), small shapes."""
    rng = np.random.default_rng(0)
    for rows, k, n, config in ((16, 512, 128, GemvConfig(128, 1, 2)), (16, 512, 128, GemvConfig(128, 2, 2)),
                               (8, 256, 64, GemvConfig(64, 1, 3)), (16, 512, 128, GemvConfig(128, 1, 2, False))):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
        out = np.asarray(gemv(x, w, config, interpret=True)).sum(0).T
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        print(f"rows={rows} K={k} N={n} {config}: relative error {err:.1e}")
        assert err < 1e-2, err
    for rows, k, n, config in ((16, 512, 128, GemvConfig(128, 1, 2)), (8, 256, 64, GemvConfig(64, 1, 3))):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w_gate, w_up = (jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(2))
        out = np.asarray(gate_up_swiglu(x, w_gate, w_up, config, interpret=True), np.float32)
        ref = np.asarray(swiglu_reference(x, w_gate, w_up), np.float32)
        diff = float(np.abs(out - ref).max())
        print(f"gate_up_swiglu rows={rows} K={k} N={n} {config}: max |diff| {diff:.3f} (max |ref| "
              f"{float(np.abs(ref).max()):.2f})")
        assert diff <= 2 ** -7 * max(1.0, float(np.abs(ref).max())), diff


def time_swiglu(tps, rows_list) -> None:
    """gate_up_swiglu against the unfused ops (XLA), at the per-device gate/up shapes of Llama-3-8B."""
    from benchmarks.decode_gemm import timed  # noqa: PLC0415 (the shared timing)
    rng = np.random.default_rng(0)
    lines = []
    for tp, rows in itertools.product(tps, rows_list):
        k, n = 4096, 14336 // tp
        nbytes = 2 * k * n * 2
        copies = max(2, -(-1_000_000_000 // nbytes))
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(2)]
        ref = np.asarray(swiglu_reference(x, *w), np.float32)
        ws = [(w[0] + 0, w[1] + 0) for _ in range(copies)]
        xla_t = timed(lambda x, w: swiglu_reference(x, *w), x, ws)
        results = []
        for bk, stages in ((64, 4), (64, 8), (128, 2), (128, 3), (128, 4), (256, 2)):
            config = GemvConfig(bk, 1, stages)
            fn = lambda x, w, config=config: gate_up_swiglu(x, *w, config)
            try:
                err = float(np.abs(np.asarray(jax.jit(fn)(x, ws[0]), np.float32) - ref).max())
                results.append((timed(fn, x, ws), err, config))
            except Exception as exc:  # a config Mosaic rejects: report and go on
                print(f"  {config}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
        del ws
        print(f"\n== tp={tp} rows={rows} gate/up + SwiGLU: K={k} N={n} x 2 ({nbytes / 1e6:.1f} MB), {copies} "
              f"copies; XLA {xla_t * 1e6:.2f} us ({nbytes / xla_t / 1e12:.2f} TB/s)", flush=True)
        for t, err, config in sorted(results, key=lambda r: r[0]):
            print(f"  {t * 1e6:8.2f} us {nbytes / t / 1e12:6.2f} TB/s  max|diff| {err:.3f}  {config}", flush=True)
        if results:
            t, err, config = min(results, key=lambda r: r[0])
            lines.append(f"tp={tp} rows={rows} gate/up+swiglu xla {xla_t * 1e6:7.2f} us | mosaic {t * 1e6:7.2f} us "
                         f"({nbytes / t / 1e12:.2f} TB/s, max|diff| {err:.3f}) block_k={config.block_k} "
                         f"stages={config.stages}")
    print(f"\n{jax.devices()[0].device_kind}: XLA's gate/up GEMMs + SwiGLU vs the fused Mosaic GPU kernel")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--check", action="store_true", help="GPU interpret mode on the CPU, small shapes")
    parser.add_argument("--shapes", nargs="+", default=None, help="default: all of decode_gemm.SHAPES")
    parser.add_argument("--configs", nargs="+", default=None, metavar="BK,SPLITS,STAGES,INPLACE",
                        help="configs to time (e.g. 128,1,8,1) instead of the sweep")
    parser.add_argument("--swiglu", action="store_true",
                        help="time gate_up_swiglu against XLA's gate/up GEMMs and SwiGLU product instead")
    args = parser.parse_args()
    if args.check:
        check()
        return
    if args.swiglu:
        time_swiglu(args.tp, args.rows)
        return
    from benchmarks.decode_gemm import SHAPES, timed  # noqa: PLC0415 (the shared timing)
    rng = np.random.default_rng(0)
    lines = []
    if args.configs:
        fields = [[int(v) for v in c.split(",")] for c in args.configs]  # BK,SPLITS,STAGES[,INPLACE]
        configs = [GemvConfig(*f[:3], *(bool(v) for v in f[3:4])) for f in fields]
    else:
        configs = [GemvConfig(bk, splits, stages)
                   for bk, splits, stages in itertools.product((128, 256), (1, 2, 4), (4, 8))]
    for tp, rows, name in itertools.product(args.tp, args.rows, args.shapes or SHAPES):
        k, n, kind = SHAPES[name]
        k, n = (k, n // tp) if kind == "col" else (k // tp, n)
        nbytes = k * n * 2
        copies = max(2, -(-1_000_000_000 // nbytes))
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w_kn = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        ref = np.asarray(x, np.float32) @ np.asarray(w_kn, np.float32)
        ws_kn = [w_kn + 0 for _ in range(copies)]
        xla_t = timed(lambda x, w: x @ w, x, ws_kn)
        del ws_kn
        ws_nk = [w_kn.T + 0 for _ in range(copies)]
        results = []
        for config in configs:
            smem = config.stages * (rows + TILE_N) * config.block_k * 2 + TILE_N * rows * 4
            if k % (config.splits * config.block_k) or smem > 200_000:
                continue
            fn = functools.partial(gemv, config=config)
            try:
                out = np.asarray(jax.jit(fn)(x, ws_nk[0])).sum(0).T
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                t = timed(fn, x, ws_nk)
            except Exception as exc:  # a config Mosaic rejects: report and go on
                print(f"  {config}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
                continue
            results.append((t, err, config))
        del ws_nk
        print(f"\n== tp={tp} rows={rows} {name}: K={k} N={n} ({nbytes / 1e6:.1f} MB), {copies} copies; "
              f"XLA {xla_t * 1e6:.2f} us ({nbytes / xla_t / 1e12:.2f} TB/s)", flush=True)
        for t, err, config in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  {t * 1e6:8.2f} us {nbytes / t / 1e12:6.2f} TB/s  err {err:.1e}  {config}", flush=True)
        if results:
            t, err, config = min(results, key=lambda r: r[0])
            lines.append(f"tp={tp} rows={rows} {name:8s} xla {xla_t * 1e6:7.2f} us | mosaic {t * 1e6:7.2f} us "
                         f"({nbytes / t / 1e12:.2f} TB/s, err {err:.0e}) {config}")
    print(f"\n{jax.devices()[0].device_kind}: XLA's dot (with its split-K sum) vs the Mosaic GPU kernel "
          "(partial sums, not summed)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
