"""Ragged paged attention for GPUs: Pallas kernels lowered through Triton.

Same semantics as `reference.ragged_paged_attention` (read its docstring), on the heads-major
cache of `layout.py`. Dimension letters as in `jaxserve/models/layers.py`; G = N // K query heads
per kv head, G' = G padded to a power of two, M = rows of one program's dots.

Data flow of one call:

    q [T, N, H] -> [T, K, G', H]
    decode rows (requests with q_len == 1):
        q[query_start_loc[r]] padded to M >= 16 rows --decode kernel, grid (R, K, splits)-->
        splits == 1: o [R, K, G', H]
        splits  > 1: partial (o, m, l) per split --combine kernel, grid (R or T, K)--> o [R or T, K, G', H]
        --scatter into zeros--> out [T, K, G', H]
    the other rows (requests with q_len >= 2: chunked prefill, fresh prompts):
        --general kernel, grid (cdiv(T, BQ) + R, K), aliased onto out--> out [T, K, G', H]
    out -> [T, N, H]
    decode_only=True (the caller's promise: every request has one query token, token r is request
    r's): o [R, K, G', H] is already in token order: cut or zero-padded to T rows (with split-K, the
    combine kernel writes the T rows itself, zeros past R), no scatter, no general kernel launched

Both kernels pack the G query heads of a kv head into the rows of one program, so every K/V
page is loaded once for all of them, and both walk only the request's real pages: the tile loop
stops at the causal limit of the program's last query row (decode: at seq_len), the page index
of a tile's tail past the last real page is clamped to that page (no new memory is touched), and
the block table is never read past the request's last page. Tiles that straddle a boundary
(seq_len, the diagonal, the sliding window's start) take the masked body; the others skip the
mask arithmetic. Masks use a finite value and select V rows to zero, and a row whose weights sum
to zero divides by one, so NaN in unused cache slots cannot reach the output.

Split-K (flash-decoding) is chosen from static shapes only (`TuningConfig.decode_splits`): a
request's tiles are dealt evenly to the splits by its own length, and one small kernel combines the
splits (as XLA ops the combine is two fusions plus a pad of the output: 3 launches per layer).
The general kernel's grid is the (request, query block) grid flattened the vLLM way: request r
owns grid rows `query_start_loc[r] // BQ + r ...`, found by a binary search, so the grid is bounded
by cdiv(T, BQ) + R instead of R * cdiv(T, BQ) and programs past a request's last block exit at once.

A mixed batch (decode rows and prefill chunks) costs no more than its parts run alone: the two
launches share one jit. Bandwidth against JAX's Pallas `paged_attention` and the mixed-batch ratio
(`benchmarks/attention.py`): benchmarks/RESULTS.md.

FP8 caches (float8_e4m3fn, `fp8.py`): the programs load fp8 K/V tiles and widen them to q's dtype in
registers (exact), so the dots run in q's dtype; a program's kv head has two static scales
(`kv_scale` [2, K]): K's multiplies the softmax scale, V's the program's output. The bf16/f32 path
takes no scale input and is unchanged.

NOTE: float32 dots run as TF32 on the GPU (Triton's reading of DEFAULT precision, like XLA's own
float32 matmuls there); interpret mode on the CPU is exact.
NOTE: the Pallas Triton backend is deprecated in JAX 0.11 (every lowering warns). It is still the
only GPU backend for `pl.pallas_call`; a Mosaic GPU (`plgpu.kernel`) port is the way forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention import fp8
from pallas_kernels.paged_attention.layout import gather_kv, kv_cache_shape, write_kv

__all__ = ["TuningConfig", "gather_kv", "kv_cache_shape", "write_kv", "ragged_paged_attention", "decode_splits"]

# Finite, so that `mask - mask` is 0 and never NaN; exp2 of (mask - real max) underflows to 0.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)
# P (in [0, 1]) times this before its fp8 rounding: the largest weight stays under 448, and weights down
# to about 2**-17 keep a nonzero fp8 value instead of flushing to zero.
FP8_P_SCALE = 256.0
FP8_DOT_DTYPES = ("q", "float16", "float8_e4m3fn")
MIN_DOT_ROWS = 16  # Triton MMA tiles need M, N, K >= 16


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static tuning knobs (hashable; passed as a static argument). Validated on construction.

    decode_block_kv / general_block_kv: K/V tokens per loop step (a power of two; rounded up to at
        least one page).
    decode_splits: KV splits of the decode kernel; None picks them from static shapes so that
        R * K * splits reaches `target_programs` while each split keeps >= `min_split_tiles` tiles.
    general_rows: query rows (tokens x G') per program of the general kernel.
    decode_fp8_block_kv / decode_fp8_num_stages: decode_block_kv and decode_num_stages over an fp8 cache
        (its tiles hold half the bytes of a bf16 tile of as many tokens).
    decode_fp8_dots: over an fp8 cache, the operand dtype of the decode kernel's dots. "q": K/V
        tiles widen to q's dtype. "float16": q is cast to float16 once per program and the tiles widen
        to it (exact: every float8_e4m3fn value is a float16; q keeps more mantissa than in bf16, and
        is clipped to float16's range). "float8_e4m3fn": no widening, the tensor cores' fp8 MMA: q is
        quantized per row (its amax to 448) once per program, P is scaled by `FP8_P_SCALE` and
        quantized per tile, and their scales multiply the f32 results (a few percent of error in the
        output where scores are peaked). No effect on other caches or on the general kernel.
    """

    decode_block_kv: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    decode_splits: int | None = None
    target_programs: int = 1024
    min_split_tiles: int = 4
    general_rows: int = 64
    general_block_kv: int = 64
    general_num_warps: int = 4
    general_num_stages: int = 2
    decode_fp8_block_kv: int = 128
    decode_fp8_num_stages: int = 5
    decode_fp8_dots: str = "float16"

    def __post_init__(self):
        for name in ("decode_block_kv", "decode_fp8_block_kv", "general_block_kv", "general_rows"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < MIN_DOT_ROWS:
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_ROWS} "
                                 "(Triton needs power-of-two shapes and dots of at least 16)")
        for name in ("decode_num_warps", "general_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={getattr(self, name)} must be one of 1, 2, 4, 8, 16")
        for name in ("decode_num_stages", "decode_fp8_num_stages", "general_num_stages"):
            if not 1 <= getattr(self, name) <= 6:
                raise ValueError(f"{name}={getattr(self, name)} must be in 1..6")
        if self.decode_fp8_dots not in FP8_DOT_DTYPES:
            raise ValueError(f"decode_fp8_dots={self.decode_fp8_dots!r} must be one of {FP8_DOT_DTYPES}")
        if self.decode_splits is not None and not _is_pow2(self.decode_splits):
            raise ValueError(f"decode_splits={self.decode_splits} must be a power of two or None")
        if self.target_programs < 1 or self.min_split_tiles < 1:
            raise ValueError(f"target_programs={self.target_programs} and "
                             f"min_split_tiles={self.min_split_tiles} must be >= 1")


def decode_splits(config: TuningConfig, num_reqs: int, num_kv_heads: int, max_tiles: int) -> int:
    """KV splits for the decode kernel, from static shapes only (a power of two)."""
    if config.decode_splits is not None:
        return config.decode_splits
    splits = 1
    while (num_reqs * num_kv_heads * splits < config.target_programs
           and max_tiles >= 2 * splits * config.min_split_tiles):
        splits *= 2
    return splits


# The shared inner loop: online softmax over K/V tiles [t0, t1) of one request and kv head.


def _tile_ranges(t0, t1, unmasked_lo, unmasked_hi):
    """Split tiles [t0, t1) into masked [t0, a), unmasked [a, b), masked [b, t1)."""
    a = jnp.minimum(jnp.maximum(unmasked_lo, t0), t1)
    b = jnp.minimum(jnp.maximum(unmasked_hi, a), t1)
    return (t0, a, True), (a, b, False), (b, t1, True)


def _attend(q, q_pos, bt_ref, k_ref, v_ref, req, seq_len, ranges, carry, *, sm_scale,
            sliding_window, pages_per_tile, k_scale=None, fp8_dots=False):
    """Online softmax over the tiles in `ranges` ((lo, hi, masked) triples).

    q [M, H] (in the dots' dtype: the cache's, or q's own over an fp8 cache), q_pos [M, 1] int32
    absolute positions of its rows. `k_scale`: an fp8 cache's K scale (a scalar), None for 1.
    `fp8_dots` (an fp8 cache only): q is quantized per row here and both dots take fp8 operands
    (`TuningConfig.decode_fp8_dots`). carry: m [M], l [M], acc [M, H] (float32). Returns the updated carry.
    """
    page_size = k_ref.shape[-2]
    block_kv = pages_per_tile * page_size
    last_page = lax.div(seq_len + page_size - 1, page_size) - 1
    scale = sm_scale * LOG2_E  # scores in the log2 domain: exp(x) == exp2(x * log2(e))
    if k_scale is not None:
        scale = scale * k_scale
    if fp8_dots:
        q32 = q.astype(jnp.float32)
        amax = jnp.max(jnp.abs(q32), axis=-1)
        q_scale = jnp.where(amax == 0.0, 1.0, amax / fp8.MAX)  # [M]; zero rows (padding) stay zero
        q = (q32 / q_scale[:, None]).astype(fp8.DTYPE)
        scale = scale * q_scale[:, None]  # [M, 1]
    dot_dtype = fp8.DTYPE if fp8_dots else q.dtype

    def body(tile, carry, masked):
        m_prev, l_prev, acc_prev = carry
        # Pages past the request's last page are clamped to it: no new memory is touched and the
        # block table is never read past the request's pages.
        # NOTE: one page index per K/V row gives a [BK, H] gather that feeds the dot directly.
        # Gathering [BK / S, S, H] per page and reshaping (as JAX's paged_attention does) reads at
        # about half the bandwidth on Hopper (benchmarks/RESULTS.md).
        row = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        page_idx = jnp.minimum(tile * pages_per_tile + lax.div(row, page_size), last_page)
        pages, slots = bt_ref[req, page_idx], lax.rem(row, page_size)  # [BK]
        k, v = k_ref[pages, slots].astype(dot_dtype), v_ref[pages, slots].astype(dot_dtype)  # [BK, H]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [M, BK]
        if masked:
            kv_pos = tile * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            mask = (kv_pos <= q_pos) & (kv_pos < seq_len)
            if sliding_window is not None:
                mask &= kv_pos > q_pos - sliding_window
            s = jnp.where(mask, s, MASK_VALUE)
            kv_real = tile * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) < seq_len
            v = jnp.where(kv_real, v, jnp.zeros_like(v))  # NaN * 0 is NaN: select, never multiply
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_prev * alpha + p.sum(axis=-1)
        if fp8_dots:
            pv = jnp.dot((p * FP8_P_SCALE).astype(v.dtype), v,
                         preferred_element_type=jnp.float32) * (1.0 / FP8_P_SCALE)
        else:
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_prev * alpha[:, None] + pv

    for lo, hi, masked in ranges:
        carry = lax.fori_loop(lo, hi, functools.partial(body, masked=masked), carry)
    return carry


def _dot_dtype(q, kv_cache):
    """The dots' operand dtype: the cache's, except over an fp8 cache, whose tiles widen to q's."""
    return q.dtype if fp8.is_fp8(kv_cache.dtype) else kv_cache.dtype


def _init_carry(rows: int, head_dim: int):
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def _first_rows(x, rows: int):
    """x[:rows] along axis 0 for a power-of-two `rows` (Triton lowers no value slices; split does)."""
    if x.shape[0] == rows:
        return x
    return jnp.split(x, x.shape[0] // rows, axis=0)[0]


# Decode kernel: one program per (request, kv head, split); q_len == 1 requests only.


def _decode_kernel(qsl_ref, seq_lens_ref, bt_ref, q_ref, k_ref, v_ref, *out_refs, sm_scale,
                   sliding_window, pages_per_tile, num_splits, group_pad, quantized, fp8_dots):
    k_scale = v_scale = None
    if quantized:  # the kv head's [K, V] scales come before the outputs
        scale_ref, *out_refs = out_refs
        k_scale, v_scale = scale_ref[0], scale_ref[1]
    req, split = pl.program_id(0), pl.program_id(2)
    q = q_ref[...]  # [M, H]
    rows, head_dim = q.shape
    block_kv = pages_per_tile * k_ref.shape[-2]
    q_len = qsl_ref[req + 1] - qsl_ref[req]
    seq_len = jnp.where(q_len == 1, seq_lens_ref[req], 0)  # other requests: an empty tile range
    q_pos = seq_len - 1

    end_tile = lax.div(seq_len + block_kv - 1, block_kv)
    first_tile = 0
    unmasked_lo = 0
    if sliding_window is not None:
        window_start = jnp.maximum(seq_len - sliding_window, 0)  # first key inside the window
        first_tile = lax.div(window_start, block_kv)
        unmasked_lo = lax.div(window_start + block_kv - 1, block_kv)
    # Deal this request's tiles evenly to the splits (by its own length, not the maximum).
    per_split = lax.div(end_tile - first_tile + num_splits - 1, num_splits)
    t0 = jnp.minimum(first_tile + split * per_split, end_tile)
    t1 = jnp.minimum(t0 + per_split, end_tile)
    ranges = _tile_ranges(t0, t1, unmasked_lo, lax.div(seq_len, block_kv))
    q_pos_rows = jnp.full((rows, 1), q_pos, jnp.int32)
    m, l, acc = _attend(q, q_pos_rows, bt_ref, k_ref, v_ref, req, seq_len, ranges,
                        _init_carry(rows, head_dim), sm_scale=sm_scale,
                        sliding_window=sliding_window, pages_per_tile=pages_per_tile, k_scale=k_scale,
                        fp8_dots=fp8_dots)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    if v_scale is not None:  # (split-K: the combine is linear in each split's output)
        out = out * v_scale
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = _first_rows(out, group_pad).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = _first_rows(out, group_pad)
        m_ref[...] = _first_rows(m, group_pad)
        l_ref[...] = _first_rows(l, group_pad)


def _decode(q4, kv_cache, qsl, seq_lens, block_tables, kv_scale, *, sm_scale, sliding_window, config,
            interpret, out_rows=None):
    """Attention for the q_len == 1 requests. Returns o [R, K, G', H] (rows of others: garbage), or with
    `out_rows` >= R (split-K only) [out_rows, K, G', H] with zeros past row R. `kv_scale`: [2, K]
    float32 for an fp8 cache, else None."""
    _, num_kv_heads, num_pages, page_size, head_dim = kv_cache.shape
    group_pad = q4.shape[2]
    num_reqs, max_blocks = block_tables.shape
    rows = max(group_pad, MIN_DOT_ROWS)
    quantized = kv_scale is not None
    block_kv = config.decode_fp8_block_kv if quantized else config.decode_block_kv
    num_stages = config.decode_fp8_num_stages if quantized else config.decode_num_stages
    pages_per_tile = max(1, block_kv // page_size)
    max_tiles = pl.cdiv(max_blocks, pages_per_tile)
    num_splits = decode_splits(config, num_reqs, num_kv_heads, max_tiles)

    # The single query row of each request (others: any in-bounds row), padded to M dot rows.
    q_dec = jnp.take(q4, qsl[:num_reqs], axis=0, mode="clip")  # [R, K, G', H]
    q_dec = jnp.pad(q_dec, ((0, 0), (0, 0), (0, rows - group_pad), (0, 0))).astype(_dot_dtype(q4, kv_cache))
    if quantized and config.decode_fp8_dots == "float16":
        f16_max = float(jnp.finfo(jnp.float16).max)
        q_dec = jnp.clip(q_dec.astype(jnp.float32), -f16_max, f16_max).astype(jnp.float16)

    full = lambda shape: pl.BlockSpec(shape, lambda r, h, s: (0,) * len(shape))
    page_spec = lambda kv: pl.BlockSpec((None, None, num_pages, page_size, head_dim),
                                        lambda r, h, s: (kv, h, 0, 0, 0))
    in_specs = [full(qsl.shape), full(seq_lens.shape), full(block_tables.shape),
                pl.BlockSpec((None, None, rows, head_dim), lambda r, h, s: (r, h, 0, 0)),
                page_spec(0), page_spec(1)]
    scales = ()
    if kv_scale is not None:
        in_specs.append(pl.BlockSpec((2, None), lambda r, h, s: (0, h)))
        scales = (kv_scale,)
    grid = (num_reqs, num_kv_heads, num_splits)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_reqs, num_kv_heads, group_pad, head_dim), q4.dtype)
        out_specs = pl.BlockSpec((None, None, group_pad, head_dim), lambda r, h, s: (r, h, 0, 0))
    else:
        part = (num_splits, num_reqs, num_kv_heads)
        out_shape = (jax.ShapeDtypeStruct((*part, group_pad, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((*part, group_pad), jnp.float32),
                     jax.ShapeDtypeStruct((*part, group_pad), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, group_pad, head_dim),
                                  lambda r, h, s: (s, r, h, 0, 0)),
                     pl.BlockSpec((None, None, None, group_pad), lambda r, h, s: (s, r, h, 0)),
                     pl.BlockSpec((None, None, None, group_pad), lambda r, h, s: (s, r, h, 0)))
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                               pages_per_tile=pages_per_tile, num_splits=num_splits,
                               group_pad=group_pad, quantized=quantized,
                               fp8_dots=quantized and config.decode_fp8_dots == "float8_e4m3fn")
    result = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=config.decode_num_warps,
                                                num_stages=num_stages),
        interpret=interpret, name="ragged_paged_attention_decode",
    )(qsl, seq_lens, block_tables, q_dec, kv_cache, kv_cache, *scales)
    if num_splits == 1:
        return result
    return _combine(*result, out_rows or num_reqs, q4.dtype, interpret)


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *, num_reqs):
    """One (row, kv head): the splits' partial outputs [S, G', H] weighted by their softmax sums."""
    m, l = m_ref[...], l_ref[...]  # [S, G'], m in the log2 domain
    m_max = jnp.max(m, axis=0)
    weight = l * jnp.exp2(m - m_max[None, :])  # empty splits: l == 0
    denom = jnp.sum(weight, axis=0)
    out = jnp.sum(o_ref[...] * weight[:, :, None], axis=0) / jnp.where(denom == 0.0, 1.0, denom)[:, None]
    out_ref[...] = jnp.where(pl.program_id(0) < num_reqs, out, 0.0).astype(out_ref.dtype)


def _combine(o_part, m_part, l_part, out_rows: int, dtype, interpret):
    """Split-K partials (o [S, R, K, G', H], m and l [S, R, K, G']) -> o [out_rows, K, G', H] in one
    kernel, rows past R zero (a decode-only step's padding tokens: no pad kernel after it)."""
    splits, num_reqs, num_kv_heads, group_pad, head_dim = o_part.shape
    row = lambda r: jnp.minimum(r, num_reqs - 1)  # rows past R read the last request's (and write zeros)
    return pl.pallas_call(
        functools.partial(_combine_kernel, num_reqs=num_reqs),
        out_shape=jax.ShapeDtypeStruct((out_rows, num_kv_heads, group_pad, head_dim), dtype),
        grid=(out_rows, num_kv_heads),
        in_specs=[pl.BlockSpec((splits, None, None, group_pad, head_dim), lambda r, h: (0, row(r), h, 0, 0)),
                  pl.BlockSpec((splits, None, None, group_pad), lambda r, h: (0, row(r), h, 0)),
                  pl.BlockSpec((splits, None, None, group_pad), lambda r, h: (0, row(r), h, 0))],
        out_specs=pl.BlockSpec((None, None, group_pad, head_dim), lambda r, h: (r, h, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="ragged_paged_attention_combine",
    )(o_part, m_part, l_part)


# General kernel: one program per (query block of a request, kv head); q_len >= 2 requests only.


def _find_request(qsl_ref, block, num_reqs: int, block_q: int):
    """The request r whose grid rows [qsl[r] // BQ + r, qsl[r + 1] // BQ + r + 1) hold `block`."""
    start = lambda r: lax.div(qsl_ref[r], block_q) + r  # strictly increasing in r

    def body(_, bounds):
        lo, hi = bounds  # invariant: start(lo) <= block, answer < hi
        mid = lax.div(lo + hi, 2)
        ok = start(mid) <= block
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    steps = max(1, math.ceil(math.log2(num_reqs))) if num_reqs > 1 else 0
    lo, _ = lax.fori_loop(0, steps, body, (jnp.int32(0), jnp.int32(num_reqs)))
    return lo


def _general_kernel(qsl_ref, seq_lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs, sm_scale,
                    sliding_window, pages_per_tile, block_q, num_reqs, num_tokens, quantized):
    # o_in is aliased to o_ref: rows this kernel does not own keep their values
    scale_ref, _, o_ref = refs if quantized else (None, *refs)
    block, head = pl.program_id(0), pl.program_id(1)
    req = _find_request(qsl_ref, block, num_reqs, block_q)
    q_start, q_end = qsl_ref[req], qsl_ref[req + 1]
    q_len = q_end - q_start
    local = block - (lax.div(q_start, block_q) + req)
    seq_len = seq_lens_ref[req]

    @pl.when((q_len >= 2) & (local * block_q < q_len) & (seq_len > 0))
    def _():
        group_pad, head_dim = q_ref.shape[2], q_ref.shape[3]
        rows = block_q * group_pad
        block_kv = pages_per_tile * k_ref.shape[-2]
        tok0 = q_start + local * block_q
        row_tok = tok0 + lax.broadcasted_iota(jnp.int32, (block_q, group_pad, head_dim), 0)
        row_ok = (row_tok < q_end) & (row_tok < num_tokens)
        q = pltriton.load(q_ref.at[pl.ds(tok0, block_q), head], mask=row_ok, other=0)
        q = q.reshape(rows, head_dim).astype(_dot_dtype(q_ref, k_ref))
        k_scale = v_scale = None
        if quantized:
            k_scale, v_scale = scale_ref[0], scale_ref[1]

        context = seq_len - q_len  # tokens cached before this step's first query row
        q_min = context + local * block_q  # position of the block's first row
        q_max = jnp.minimum(q_min + block_q - 1, seq_len - 1)  # last real row: causal limit
        q_pos = q_min + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group_pad)
        end_tile = lax.div(q_max + block_kv, block_kv)
        first_tile = 0
        unmasked_lo = 0
        if sliding_window is not None:
            first_tile = lax.div(jnp.maximum(q_min - sliding_window + 1, 0), block_kv)
            unmasked_lo = lax.div(jnp.maximum(q_max - sliding_window + 1, 0) + block_kv - 1,
                                  block_kv)
        # Tiles wholly at or before the first row's position need no causal mask.
        ranges = _tile_ranges(first_tile, end_tile, unmasked_lo, lax.div(q_min + 1, block_kv))
        m, l, acc = _attend(q, q_pos, bt_ref, k_ref, v_ref, req, seq_len, ranges,
                            _init_carry(rows, head_dim), sm_scale=sm_scale,
                            sliding_window=sliding_window, pages_per_tile=pages_per_tile,
                            k_scale=k_scale)
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        if v_scale is not None:
            out = out * v_scale
        out = out.reshape(block_q, group_pad, head_dim).astype(o_ref.dtype)
        pltriton.store(o_ref.at[pl.ds(tok0, block_q), head], out, mask=row_ok)


def _general(q4, kv_cache, qsl, seq_lens, block_tables, kv_scale, out, *, sm_scale, sliding_window,
             config, interpret):
    """Attention for the q_len >= 2 requests, written into their rows of `out` [T, K, G', H]."""
    num_tokens, num_kv_heads, group_pad, head_dim = q4.shape
    _, _, num_pages, page_size, _ = kv_cache.shape
    num_reqs = block_tables.shape[0]
    block_q = max(1, config.general_rows // group_pad, MIN_DOT_ROWS // group_pad)
    pages_per_tile = max(1, config.general_block_kv // page_size)
    grid = (pl.cdiv(num_tokens, block_q) + num_reqs, num_kv_heads)

    full = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    page_spec = lambda kv: pl.BlockSpec((None, None, num_pages, page_size, head_dim),
                                        lambda b, h: (kv, h, 0, 0, 0))
    kernel = functools.partial(_general_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                               pages_per_tile=pages_per_tile, block_q=block_q,
                               num_reqs=num_reqs, num_tokens=num_tokens, quantized=kv_scale is not None)
    scale_specs = [pl.BlockSpec((2, None), lambda b, h: (0, h))] if kv_scale is not None else []
    scales = (kv_scale,) if kv_scale is not None else ()
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype), grid=grid,
        in_specs=[full(qsl.shape), full(seq_lens.shape), full(block_tables.shape),
                  full(q4.shape), page_spec(0), page_spec(1), *scale_specs, full(out.shape)],
        out_specs=full(out.shape), input_output_aliases={6 + len(scales): 0},
        compiler_params=pltriton.CompilerParams(num_warps=config.general_num_warps,
                                                num_stages=config.general_num_stages),
        interpret=interpret, name="ragged_paged_attention_general",
    )(qsl, seq_lens, block_tables, q4, kv_cache, kv_cache, *scales, out)



@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "interpret", "config", "decode_only"))
def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, P, S, H]
    query_start_loc: jax.Array,  # [R + 1] int32
    seq_lens: jax.Array,  # [R] int32, tokens in the cache for each request, including this step's
    block_tables: jax.Array,  # [R, max_blocks] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    interpret: bool = False,
    config: TuningConfig | None = None,
    decode_only: bool = False,
    kv_scale: jax.Array | None = None,  # [2, K] float32: an fp8 cache's K and V scales (None: 1)
) -> jax.Array:
    """Ragged paged attention; the semantics of `reference.ragged_paged_attention`. -> [T, N, H].

    `decode_only`: the caller guarantees a pure decode batch, request r's single query token being
    token r (query_start_loc[r] == r for the real requests; padding requests after them, with no
    tokens). The decode kernel's output is then the output in token order: no scatter, and no
    launch of the general kernel (the engine's decode steps; a plain batch takes the general path).
    """
    config = TuningConfig() if config is None else config
    num_tokens, num_q_heads, head_dim = q.shape
    two, num_kv_heads, _, page_size, cache_head_dim = kv_cache.shape
    num_reqs = block_tables.shape[0]
    if two != 2 or cache_head_dim != head_dim:
        raise ValueError(f"kv_cache {kv_cache.shape} is not [2, K, P, S, H={head_dim}] "
                         "(use layout.kv_cache_shape)")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if not (_is_pow2(head_dim) and head_dim >= MIN_DOT_ROWS and _is_pow2(page_size)):
        raise ValueError(f"head_dim={head_dim} and page size {page_size} must be powers of two "
                         "(head_dim >= 16): Triton only handles power-of-two shapes")
    if query_start_loc.shape != (num_reqs + 1,) or seq_lens.shape != (num_reqs,):
        raise ValueError(f"query_start_loc {query_start_loc.shape} and seq_lens {seq_lens.shape} "
                         f"do not match block_tables {block_tables.shape}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")

    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_pad != group:  # Triton shapes are powers of two: pad the heads, drop them at the end
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    qsl = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    common = dict(sm_scale=float(sm_scale), sliding_window=sliding_window, config=config,
                  interpret=interpret)
    if fp8.is_fp8(kv_cache.dtype):
        kv_scale = (fp8.unit_scales(num_kv_heads) if kv_scale is None
                    else kv_scale.astype(jnp.float32).reshape(2, num_kv_heads))
    else:
        kv_scale = None  # a cache in a float dtype holds the values themselves

    # decode_only: token r is request r's query, rows past the requests are padding (zero); a split-K
    # decode writes them in its combine
    out_rows = num_tokens if decode_only and num_tokens > num_reqs else None
    o_dec = _decode(q4, kv_cache, qsl, seq_lens, block_tables, kv_scale, out_rows=out_rows, **common)
    if decode_only:
        out = (o_dec[:num_tokens] if o_dec.shape[0] >= num_tokens
               else jnp.pad(o_dec, ((0, num_tokens - num_reqs), (0, 0), (0, 0), (0, 0))))
    else:
        is_decode = (qsl[1:] - qsl[:-1]) == 1
        rows = jnp.where(is_decode, qsl[:-1], num_tokens)  # others are dropped
        out = jnp.zeros(q4.shape, q.dtype).at[rows].set(o_dec, mode="drop")
        if num_tokens > 1:
            out = _general(q4, kv_cache, qsl, seq_lens, block_tables, kv_scale, out, **common)
    if group_pad != group:
        out = out[:, :, :group]
    return out.reshape(num_tokens, num_q_heads, head_dim)
