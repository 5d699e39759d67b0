"""An FP8 (W8A8) decode GEMM on Hopper's TMA + wgmma (Mosaic GPU).

    fp8_gemv(x [M, K] bf16, q [N, K] float8_e4m3fn, w_scale [N] f32) -> y [M, N] bf16
    y[m, n] ~= x[m, :] @ (q[n, :] * w_scale[n])

wgmma multiplies float8_e4m3fn operands only when both are fp8, so the decode rows are quantized too
(W8A8): per row, x_scale = max|x_row| / 448 and xq = fp8(x * (448 / max|x_row|)), rounded to nearest even
(an all-zero row: scale 1, xq 0). The multiplier form makes the rounding reproducible: a bf16 row gives
many exact ties, which an f32 multiply keeps exact on every backend. `quantize_rows` does this in one
small XLA fusion before the kernel, padding the rows to Mp (a multiple of 8, wgmma's N granularity) with
zeros. (Inside the kernel it would cost every CTA a pass over all of x for the row maxima before its
first product.)

The kernel (`fp8_gemv_quantized`): grid (N / 64, splits), 2 warpgroups per CTA. The weight is wgmma's A
operand (64 output features per CTA), the padded rows its N. The producer TMA-loads [64, BK] weight
tiles and [Mp, BK] xq tiles into a ring of `stages` SMEM slots (K-major, 128-byte swizzle: 128 fp8
elements per swizzled row, as 8-bit wgmma operands must be: they take no transposes) and refills a slot
once the consumer has released it. The consumer accumulates [64, Mp] in f32 with each wgmma left in
flight across the next step's wait and releases a slot one step later. The epilogue multiplies by
w_scale[n] * x_scale[m]: with one split it writes bf16 [M, N] (the real rows only); with K splits it
writes f32 partials [splits, N, Mp] (already scaled), summed, transposed and cast by XLA after the call.

Weight layout: [N, K] (K contiguous), the transpose of the `x @ W` matrix form: a single-device engine holds
its per-channel fp8 weights this way (models/quant.py `Fp8Weight.transposed_shape`) and quant.linear calls
`fp8_gemv` for decode-sized steps, with the tuning `choose_config` picks for the shape.

Numerics: wgmma's fp8 products are exact and summed in f32 on the GPU (Hopper's fp8 accumulation keeps
fewer mantissa bits than a full f32 add, so long K differs slightly from `reference`, an f32 matmul).
`interpret=True` runs the kernel in GPU interpret mode on a CPU (tests/test_fp8_gemm_mosaic.py);
`benchmarks/fp8_gemm_mgpu.py` times it.

NOTE: sm_90a only (wgmma): `runs_on` says whether a device takes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
TILE_N = 64  # wgmma's M: output features per CTA
MAX_ROWS = 256  # wgmma's largest N; decode steps use 1..64
SMEM_BYTES = 227 * 1024  # an H100/H200 CTA's shared memory
NUM_SMS = 132  # an H100 SXM's or H200's SMs: the CTAs `auto_splits` aims to fill


@dataclasses.dataclass(frozen=True)
class Fp8GemvConfig:
    block_k: int = 256  # K per ring slot: a multiple of 128 (one 128-byte swizzle row of fp8)
    stages: int = 4  # ring slots
    splits: int = 1  # K splits: more CTAs for a short, wide weight; partials summed by XLA


def runs_on(device) -> bool:
    """Whether `device` takes the kernel: a Hopper GPU (sm_90a, the only target with wgmma)."""
    capability = str(getattr(device, "compute_capability", ""))
    return getattr(device, "platform", None) == "gpu" and capability.startswith("9.")


def auto_splits(k: int, n: int, block_k: int, num_sms: int = NUM_SMS) -> int:
    """The fewest K splits that give about one CTA per SM (N / 64 CTAs per split), dividing K's blocks."""
    ctas, blocks = n // TILE_N, k // block_k
    splits = min(blocks, max(1, -(-num_sms // ctas)))
    while blocks % splits:
        splits += 1
    return splits


def choose_config(m: int, k: int, n: int, num_sms: int = NUM_SMS) -> Fp8GemvConfig | None:
    """The tuning for x [m, K] times q [N, K]: block_k 256 (128 where K is no multiple of 256), 4 stages
    (the fastest at the Llama-3-8B decode shapes: benchmarks/fp8_gemm_mgpu.py) and `auto_splits`; None
    where the kernel does not take the shape (N off 64, K off 128, m past MAX_ROWS or SMEM)."""
    if n % TILE_N or k % 128 or not 1 <= m <= MAX_ROWS:
        return None
    block_k = 256 if k % 256 == 0 else 128
    config = Fp8GemvConfig(block_k=block_k, stages=4, splits=auto_splits(k, n, block_k, num_sms))
    return config if smem_bytes(padded_rows(m), config) <= SMEM_BYTES else None


def padded_rows(m: int) -> int:
    """wgmma's N for m decode rows: the next multiple of 8."""
    return -(-m // 8) * 8


def smem_bytes(rows: int, config: Fp8GemvConfig) -> int:
    """SMEM one CTA needs for `rows` padded rows: the ring, the scales and the output tile."""
    out = TILE_N * rows * (2 if config.splits == 1 else 4)
    return config.stages * (TILE_N + rows) * config.block_k + 4 * (TILE_N + rows) + out


def check_shapes(m: int, k: int, n: int, config: Fp8GemvConfig) -> None:
    """Raises ValueError naming what is wrong where the kernel cannot take these shapes."""
    bk, splits = config.block_k, config.splits
    rows = padded_rows(m)
    if bk % 128 or config.stages < 1 or splits < 1:
        raise ValueError(f"{config}: block_k must be a multiple of 128, stages and splits at least 1")
    if n % TILE_N or k % (splits * bk):
        raise ValueError(f"N = {n} must be a multiple of {TILE_N} and K = {k} of splits x block_k = "
                         f"{splits * bk}; pick another block_k or splits")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"M = {m} rows: the kernel takes 1..{MAX_ROWS} (wgmma's N)")
    if smem_bytes(rows, config) > SMEM_BYTES:
        raise ValueError(f"{config} at {rows} padded rows needs {smem_bytes(rows, config)} bytes of SMEM "
                         f"(at most {SMEM_BYTES}): lower stages or block_k")


def quantize_rows(x: jax.Array, rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-row (per-token) dynamic fp8 quantization: x [M, K] -> xq [Mp, K] float8_e4m3fn and
    x_scale [Mp] f32 with x ~= xq * x_scale[:, None] (module docstring); rows M..Mp-1 are zero (scale 1)."""
    m = x.shape[0]
    rows = padded_rows(m) if rows is None else rows
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    multiplier = jnp.where(amax > 0, FP8_MAX / amax, 1.0)
    xq = jnp.clip(x32 * multiplier[:, None], -FP8_MAX, FP8_MAX).astype(FP8)  # no rounding past 448
    return jnp.pad(xq, ((0, rows - m), (0, 0))), jnp.pad(scale, (0, rows - m), constant_values=1.0)


def _transforms(minor: int, dtype):
    """SMEM tiling + swizzle for a [rows, minor] operand or tile (the widest swizzle that fits)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if (minor * itemsize) % s == 0)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(x_ref, q_ref, xs_ref, ws_ref, o_ref, x_smem, q_smem, xs_smem, ws_smem, out_smem, x_ready,
            q_ready, free, scales_ready, *, block_k: int, steps: int, stages: int, split_out: bool):
    rows = x_ref.shape[0]
    n_tile, split = lax.axis_index("n"), lax.axis_index("s")
    features = pl.ds(n_tile * TILE_N, TILE_N)
    k_first = split * (steps * block_k)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _consumer():
        plgpu.copy_gmem_to_smem(xs_ref, xs_smem, scales_ready.at[0])
        plgpu.copy_gmem_to_smem(ws_ref.at[features], ws_smem, scales_ready.at[1])

        def accumulate(acc_ref):
            def step(j, carry):
                slot = lax.rem(j, jnp.int32(stages))
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.barrier_wait(q_ready.at[slot])
                plgpu.wgmma(acc_ref, q_smem.at[slot], x_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(1)  # step j - 1's product is done: its slot can be refilled

                @pl.when(j > 0)
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(j + stages - 1, jnp.int32(stages))])
                return carry

            lax.fori_loop(0, steps, step, None)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(free.at[(steps - 1) % stages])
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, rows), jnp.float32))  # starts at zero
        plgpu.barrier_wait(scales_ready.at[0])
        plgpu.barrier_wait(scales_ready.at[1])
        w_scale = plgpu.load(ws_smem, layout=plgpu.Layout.WGMMA.reduce(1))
        x_scale = plgpu.load(xs_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        acc = acc * lax.broadcast_in_dim(w_scale, (TILE_N, rows), [0])
        acc = acc * lax.broadcast_in_dim(x_scale, (TILE_N, rows), [1])
        if split_out:
            out_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, o_ref.at[split, features])
        else:
            out_smem.transpose((1, 0))[...] = acc.astype(o_ref.dtype)  # [64, Mp] registers -> [Mp, 64]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, o_ref.shape[0])], o_ref.at[:, features])  # M rows
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        def load(j, slot):
            ks = pl.ds(k_first + j * block_k, block_k)
            plgpu.copy_gmem_to_smem(x_ref.at[:, ks], x_smem.at[slot], x_ready.at[slot])
            plgpu.copy_gmem_to_smem(q_ref.at[features, ks], q_smem.at[slot], q_ready.at[slot])

        for j in range(min(stages, steps)):
            load(j, j)

        @pl.loop(stages, steps)
        def _(j):
            slot = lax.rem(j, jnp.int32(stages))
            plgpu.barrier_wait(free.at[slot])
            load(j, slot)

        for slot in range(min(stages, steps)):  # every barrier phase is observed before the CTA exits
            plgpu.barrier_wait(free.at[slot])


def fp8_gemv_quantized(xq: jax.Array, x_scale: jax.Array, q: jax.Array, w_scale: jax.Array, *,
                       config: Fp8GemvConfig = Fp8GemvConfig(), m: int | None = None,
                       interpret: bool = False) -> jax.Array:
    """The kernel alone: xq [Mp, K] fp8 (Mp a multiple of 8), x_scale [Mp] f32, q [N, K] fp8, w_scale [N]
    f32 -> bf16 [m, N], the first m rows (default Mp), with splits == 1; else scaled f32 partial sums
    [splits, N, Mp] (transposed, all Mp rows)."""
    rows, k = xq.shape
    n = q.shape[0]
    m = rows if m is None else m
    if (not 1 <= m <= rows or rows % 8 or xq.dtype != FP8 or q.dtype != FP8 or q.shape[1] != k
            or x_scale.shape != (rows,) or w_scale.shape != (n,)):
        raise ValueError(f"xq {xq.shape} {xq.dtype}, x_scale {x_scale.shape}, q {q.shape} {q.dtype}, w_scale "
                         f"{w_scale.shape}: want xq [Mp, K] and q [N, K] float8_e4m3fn (Mp a multiple of 8), "
                         f"x_scale [Mp], w_scale [N], 1 <= m = {m} <= Mp")
    check_shapes(rows, k, n, config)
    bk, splits, stages = config.block_k, config.splits, config.stages
    split_out = splits > 1
    kernel = functools.partial(_kernel, block_k=bk, steps=k // (splits * bk), stages=stages,
                               split_out=split_out)
    if split_out:
        out_type = jax.ShapeDtypeStruct((splits, n, rows), jnp.float32)
        out_smem = plgpu.SMEM((TILE_N, rows), jnp.float32)
    else:
        out_type = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
        out_smem = plgpu.SMEM((rows, TILE_N), jnp.bfloat16)  # untiled: the TMA store takes its first m rows
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            plgpu.SMEM((stages, rows, bk), FP8, transforms=_transforms(bk, FP8)),
            plgpu.SMEM((stages, TILE_N, bk), FP8, transforms=_transforms(bk, FP8)),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((TILE_N,), jnp.float32),
            out_smem,
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2),
        ),
        grid=(n // TILE_N, splits),
        grid_names=("n", "s"),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(xq, q, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32))


def fp8_gemv(x: jax.Array, q: jax.Array, w_scale: jax.Array, *, config: Fp8GemvConfig = Fp8GemvConfig(),
             interpret: bool = False) -> jax.Array:
    """x [M, K] @ (q [N, K] fp8 * w_scale[:, None]).T -> [M, N] bf16, x quantized per row to fp8 first
    (module docstring)."""
    m, k = x.shape
    n = q.shape[0]
    if q.shape != (n, k) or w_scale.shape != (n,):
        raise ValueError(f"x {x.shape}, q {q.shape}, w_scale {w_scale.shape}: want q [N, K] with x's K and "
                         "w_scale [N]")
    check_shapes(m, k, n, config)
    xq, x_scale = quantize_rows(x)
    out = fp8_gemv_quantized(xq, x_scale, q, w_scale, config=config, m=m, interpret=interpret)
    if config.splits > 1:
        return out.sum(axis=0).T[:m].astype(jnp.bfloat16)
    return out


def reference(x, q, w_scale):
    """The same W8A8 math in jnp f32: x quantized as `quantize_rows` does, both operands dequantized."""
    xq, x_scale = quantize_rows(x, x.shape[0])
    xd = xq.astype(jnp.float32) * x_scale[:, None]
    wd = q.astype(jnp.float32) * w_scale.astype(jnp.float32)[:, None]
    return jnp.matmul(xd, wd.T, precision=lax.Precision.HIGHEST)
