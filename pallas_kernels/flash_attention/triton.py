"""Causal GQA flash attention for long prompts: a Pallas Triton kernel (GPU).

Data flow of one call (dimension letters as in `jaxserve/models/layers.py`):

    q [B, Tq, N, H], k/v [B, Tkv, K, H], seq_lens [B], q_offset [B] (both optional)
      --pad Tq, Tkv to the tiles, H to a power of two (only when needed)-->
      pallas_call grid (N, Tq // block_q, B): one program owns block_q query rows of one q head
        and streams the K/V rows of kv head n // G through an online softmax
      --> out [B, Tq, N, H]

The kernel reads the engine's token-major layout directly: a BlockSpec on Triton is a pointer
offset, so a [block_q, H] tile of one head is block_q rows of H contiguous elements with a stride of
N * H, and no heads-major transpose is made. Semantics match `reference.flash_attention_reference`:
row i of sequence b sits at position p = q_offset[b] + i (no offset: p = i, Tq == Tkv) and attends to keys
0..p below `seq_lens[b]` (None: Tkv); rows at positions at or past `seq_lens[b]` are zeros; K/V past
`seq_lens[b]` may hold anything (NaN included). The offset is read per program from a [1] block, so the
tile bounds below are in absolute positions.

Per program the KV loop has two parts: tiles wholly below the diagonal (and inside the length) run
without any mask arithmetic; the few tiles that cross the diagonal or the length run masked. Tiles
wholly above the diagonal are never visited. Logits are scaled by sm_scale * log2(e) so the softmax
uses exp2, with the running max kept in that scaled domain.

NOTE: on Hopper the package's `flash_attention` runs `mosaic_gpu.py` (TMA + wgmma) for the calls it
supports; this kernel serves the rest (seq_lens, non-causal, float32, odd G) and other GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# NOTE: finite, so that masked - max never becomes -inf - -inf = NaN; exp2 of it is exactly 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2_E = math.log2(math.e)
_SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Tiling and Triton launch knobs; hashable, so it is passed to the jitted wrapper statically.

    block_q: query rows per program (the M of both matmuls).
    block_k: key rows per loop step (the N of QK^T, the K of PV).
    num_warps: warps per program; 8 lets Hopper run two 64-row wgmma warpgroups on a 128-row tile.
    num_stages: software-pipelining depth of the K/V loads.
    """

    block_q: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        # NOTE: every Triton op must be on power-of-two shapes, and dots want each dim >= 16.
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value!r} must be a power of two >= 16 (Triton tiles)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps!r} must be one of 1, 2, 4, 8, 16")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages={self.num_stages!r} must be an int in 1..8")


def default_config(head_dim: int, dtype=jnp.bfloat16) -> FlashAttentionConfig:
    """The tuned default for one head dim and dtype (H200; see benchmarks/prefill_attention.py)."""
    if jnp.dtype(dtype) == jnp.float32:
        # NOTE: f32 tiles are twice the bytes and its exact dot runs on FMAs: keep SMEM and registers small.
        return FlashAttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return FlashAttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
    # NOTE: the best of a tile sweep for bf16, H=128 on Hopper (benchmarks/RESULTS.md, prefill attention).
    return FlashAttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=3)


def _div(x, d: int):
    """x // d for a traced int32 scalar (Python `//` does not lower on program ids)."""
    if isinstance(x, int):
        return x // d
    return lax.div(x, jnp.int32(d))


def _flash_kernel(
    *refs,
    block_q: int,
    block_k: int,
    num_q_blocks: int,
    scale_log2: float,
    causal: bool,
    has_lens: bool,
    has_offset: bool,
    precision,
):
    q_ref, k_ref, v_ref, *refs, o_ref = refs  # q/o [block_q, H]; k/v [Tkv, H]
    if has_offset:
        offset_ref, *refs = refs  # [1]
    if has_lens:
        (lens_ref,) = refs  # [1]
        kv_len = lens_ref[0]
    else:
        kv_len = k_ref.shape[0]
    num_kv_tiles = k_ref.shape[0] // block_k
    # NOTE: q blocks run last-first (the index_maps agree): the longest causal rows start in the
    # first wave and the short ones fill the tail.
    q_block = num_q_blocks - 1 - pl.program_id(1)
    q_start = q_block * block_q  # the block's first row; its absolute position (key index) is q_start + offset
    if has_offset:
        q_start = q_start + offset_ref[0]

    if causal:
        end = _div(q_start + block_q + block_k - 1, block_k)  # tiles touching rows q_start..+block_q
        full = _div(q_start + 1, block_k)  # tiles wholly visible to the first row
        if has_offset:  # keys past the (static) K/V length are never read
            end = jnp.minimum(end, num_kv_tiles)
            full = jnp.minimum(full, end)
    else:
        end = full = num_kv_tiles
    if has_lens:
        end = jnp.minimum(end, _div(kv_len + block_k - 1, block_k))
        full = jnp.minimum(full, _div(kv_len, block_k))
        end = jnp.where(q_start < kv_len, end, 0)  # a block of padding rows does no work
        full = jnp.minimum(full, end)

    q = q_ref[...]
    head_dim = q.shape[-1]
    rows = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    cols = lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    v_rows = lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)

    def step(j, carry, masked: bool):
        acc, m, l = carry  # acc [block_q, H] f32; m, l [block_q] f32, m in the log2 domain
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)
        if masked:
            keep = None
            if causal:
                keep = start + cols <= rows
            if has_lens:
                in_len = start + cols < kv_len
                keep = in_len if keep is None else keep & in_len
                # NOTE: p == 0 there, but 0 * NaN is NaN: select garbage V rows away too.
                v = jnp.where(start + v_rows < kv_len, v, jnp.zeros_like(v))
            if keep is not None:
                s = jnp.where(keep, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1) * scale_log2)
        p = jnp.exp2(s * scale_log2 - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
        return acc * alpha[:, None] + pv, m_new, l

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
    if causal or has_lens:
        carry = lax.fori_loop(full, end, functools.partial(step, masked=True), carry)
    acc, _, l = carry
    # l == 0 only for rows that saw no key (kv_len == 0, or a skipped padding block): acc is 0 there.
    out = acc * (1.0 / jnp.where(l == 0.0, 1.0, l))[:, None]
    if has_lens:
        row_ids = q_start + lax.broadcasted_iota(jnp.int32, (block_q, head_dim), 0)
        out = jnp.where(row_ids < kv_len, out, 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _check_inputs(q, k, v, seq_lens, q_offset=None) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q must be [B, Tq, N, H] and k, v [B, Tkv, K, H]; got q {q.shape}, k {k.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    batch, num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v {k.shape} must match q {q.shape} in B and H")
    if q_offset is None and k.shape[1] != num_tokens:
        raise ValueError(f"k/v {k.shape} and q {q.shape} differ in length: pass q_offset (the position "
                         "of q's first row) for queries that continue a cached prefix")
    if num_q_heads % k.shape[2]:
        raise ValueError(f"{num_q_heads} q heads must be a multiple of {k.shape[2]} kv heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q, k, v must share one of bfloat16/float16/float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, lens in (("seq_lens", seq_lens), ("q_offset", q_offset)):
        if lens is not None and lens.shape != (batch,):
            raise ValueError(f"{name} must be [B] = ({batch},); got {lens.shape}")


def _fit_blocks(config: FlashAttentionConfig, num_tokens: int) -> tuple[int, int]:
    """Shrink tiles for short prompts so a tiny T is not padded up to a 128-row tile."""
    cap = max(16, pl.next_power_of_2(num_tokens))
    return min(config.block_q, cap), min(config.block_k, cap)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "config", "interpret"))
def flash_attention(
    q: jax.Array,  # [B, Tq, N, H]
    k: jax.Array,  # [B, Tkv, K, H]
    v: jax.Array,  # [B, Tkv, K, H]
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    seq_lens: jax.Array | None = None,  # [B] int32, valid keys per sequence (<= Tkv)
    q_offset: jax.Array | None = None,  # [B] int32, the absolute position of q's row 0 (None: 0)
    config: FlashAttentionConfig | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Tq, N, H], q.dtype
    """Causal attention of q row i (at position q_offset + i) over keys 0..that position; q head n reads
    kv head n // (N // K). Without `q_offset` q and k/v are one fresh prompt (Tq == Tkv)."""
    _check_inputs(q, k, v, seq_lens, q_offset)
    batch, num_tokens, num_q_heads, head_dim = q.shape
    kv_tokens = k.shape[1]
    group = num_q_heads // k.shape[2]
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    if config is None:
        config = default_config(head_dim, q.dtype)
    block_q, block_k = _fit_blocks(config, max(num_tokens, kv_tokens))
    has_offset = q_offset is not None

    # NOTE: padding copies the inputs; the engine's buckets keep T a multiple of 128 so this is
    # skipped in serving. Padded keys are masked through the lengths.
    if has_offset:
        padded_tokens = -(-num_tokens // block_q) * block_q
        padded_kv = -(-kv_tokens // block_k) * block_k
    else:
        padded_tokens = padded_kv = -(-num_tokens // max(block_q, block_k)) * max(block_q, block_k)
    padded_dim = pl.next_power_of_2(head_dim)
    if seq_lens is None and (padded_kv != kv_tokens or has_offset):
        seq_lens = jnp.full((batch,), kv_tokens, jnp.int32)  # (with an offset: rows past Tkv are zeros)
    if (padded_tokens, padded_dim) != (num_tokens, head_dim):
        q = jnp.pad(q, ((0, 0), (0, padded_tokens - num_tokens), (0, 0), (0, padded_dim - head_dim)))
    if (padded_kv, padded_dim) != (kv_tokens, head_dim):
        pad = ((0, 0), (0, padded_kv - kv_tokens), (0, 0), (0, padded_dim - head_dim))
        k, v = (jnp.pad(x, pad) for x in (k, v))

    num_q_blocks = padded_tokens // block_q
    has_lens = seq_lens is not None
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _flash_kernel, block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks,
        scale_log2=float(sm_scale) * LOG2_E, causal=causal, has_lens=has_lens, has_offset=has_offset,
        precision=precision)

    def q_map(h, i, b):
        return b, num_q_blocks - 1 - i, h, 0

    def kv_map(h, i, b):
        return b, 0, h // group, 0  # GQA: the G q heads of one kv head are adjacent programs

    def row_map(h, i, b):
        return (b,)

    in_specs = [
        pl.BlockSpec((None, block_q, None, padded_dim), q_map),
        pl.BlockSpec((None, padded_kv, None, padded_dim), kv_map),
        pl.BlockSpec((None, padded_kv, None, padded_dim), kv_map),
    ]
    args = [q, k, v]
    if has_offset:
        in_specs.append(pl.BlockSpec((1,), row_map))
        args.append(jnp.maximum(q_offset.astype(jnp.int32), 0))
    if has_lens:
        in_specs.append(pl.BlockSpec((1,), row_map))
        args.append(jnp.clip(seq_lens.astype(jnp.int32), 0, kv_tokens))

    out = pl.pallas_call(
        kernel,
        # NOTE: heads vary fastest (grid axis 0 is CUDA's x), so the programs sharing one kv head's
        # K/V run together and hit L2; q blocks go longest-first along axis 1.
        grid=(num_q_heads, num_q_blocks, batch),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, padded_dim), q_map),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(*args)
    return out[:, :num_tokens, :, :head_dim]
