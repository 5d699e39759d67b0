"""Weight-only FP8 GEMM for decode-sized steps on GPUs (Pallas lowered through Triton).

    y = x @ (q * scale):  x [M, K] (bf16 / f16 / f32), q [K, N] float8_e4m3fn (the `x @ W` layout),
                          scale [N] float32 (one per output column) -> y [M, N] in x's dtype

A decode step reads every weight once for a few rows, so its time is the weight bytes over the memory
bandwidth: FP8 weights halve them. XLA's own fp8 dots at these shapes are slower than bf16 (they convert
the whole weight first), so this kernel streams the fp8 bytes and widens each tile in registers.

    grid (N / BN, S): program (j, s) owns column strip j and the s-th of S equal runs of K blocks
        acc [Mp, BN] f32 = sum over its K blocks of x [Mp, BK] @ widen(q [BK, BN])
        S == 1: y[:, strip] = acc * scale[strip]   (in x's dtype)
        S  > 1: partial [S, Mp, N] f32, summed, scaled and cast by XLA after the call

M is padded to Mp >= 16 rows (the dot's minimum). S (split-K) is chosen from static shapes so that
N / BN x S programs fill the GPU's cores about twice: a short, wide weight (wk, wv) takes more splits
than a tall one. `interpret=True` runs the kernel on a CPU (tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

FP8 = jnp.float8_e4m3fn
MAX_ROWS = 64  # the largest M this kernel takes (a decode step's rows); larger steps dequantize in XLA


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 5
    num_cores: int = 132  # H200 SMs
    max_splits: int = 16


def fitted(config: TuningConfig, n: int) -> TuningConfig:
    """The config for N output columns: its column strip narrowed to 64 where N is a multiple of 64 but not
    of block_n."""
    if n % config.block_n and not n % 64 and config.block_n > 64:
        return dataclasses.replace(config, block_n=64)
    return config


def num_splits(config: TuningConfig, k: int, n: int) -> int:
    """Split-K factor: enough programs for about two per core, dividing the K blocks evenly."""
    strips, k_blocks = n // config.block_n, k // config.block_k
    want = max(1, min(config.max_splits, k_blocks, -(-2 * config.num_cores // strips)))
    while k_blocks % want:
        want -= 1
    return want


def supported(m: int, k: int, n: int, config: TuningConfig | None = None) -> bool:
    """Shapes the kernel takes: M <= MAX_ROWS, K and N multiples of its blocks (fitted to N)."""
    config = fitted(config or TuningConfig(), n)
    return m <= MAX_ROWS and k % config.block_k == 0 and n % config.block_n == 0


def _kernel(x_ref, q_ref, scale_ref, out_ref, *, block_k: int, k_per_split: int, split: bool):
    s = pl.program_id(1)

    def body(i, acc):
        k0 = pl.multiple_of((s * k_per_split + i) * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]
        w = q_ref[pl.ds(k0, block_k), :].astype(x.dtype)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_per_split, body, jnp.zeros(out_ref.shape[-2:], jnp.float32))
    if split:
        out_ref[...] = acc[None]
    else:
        out_ref[...] = (acc * scale_ref[...][None, :]).astype(out_ref.dtype)


def fp8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, config: TuningConfig | None = None,
               interpret: bool = False) -> jax.Array:
    """x [M, K] @ (q [K, N] fp8 * scale [N]) -> [M, N] in x's dtype (module docstring)."""
    (m, k), n = x.shape, q.shape[1]
    config = fitted(config or TuningConfig(), n)
    if not supported(m, k, n, config) or q.shape[0] != k or scale.shape != (n,):
        raise ValueError(f"fp8_matmul takes x [M <= {MAX_ROWS}, K], q [K, N], scale [N] with K % "
                         f"{config.block_k} == 0 and N % {config.block_n} == 0; got {x.shape}, {q.shape}, "
                         f"{scale.shape}")
    rows = max(16, 1 << (m - 1).bit_length())
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    splits = num_splits(config, k, n)
    k_per_split = k // config.block_k // splits
    grid = (n // config.block_n, splits)
    in_specs = [pl.BlockSpec((rows, k), lambda j, s: (0, 0)),
                pl.BlockSpec((k, config.block_n), lambda j, s: (0, j)),
                pl.BlockSpec((config.block_n,), lambda j, s: (j,))]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
        out_spec = pl.BlockSpec((rows, config.block_n), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, rows, n), jnp.float32)
        out_spec = pl.BlockSpec((1, rows, config.block_n), lambda j, s: (s, 0, j))
    kernel = lambda *refs: _kernel(*refs, block_k=config.block_k, k_per_split=k_per_split,  # noqa: E731
                                   split=splits > 1)
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="fp8_matmul")(xp, q, scale.astype(jnp.float32))
    if splits > 1:
        out = (out.sum(axis=0) * scale[None, :]).astype(x.dtype)
    return out[:m]
