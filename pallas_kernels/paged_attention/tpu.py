"""Ragged paged attention as a Mosaic TPU kernel (Pallas, scalar prefetch). Same semantics as `reference`.

Data flow of one call (dimension letters as in `jaxserve/models/layers.py`; G = N // K q heads per kv head,
W work items, Q = block_q query tokens per work item, M = Q * G rows padded to the sublane tile):

    q [T, N, H] --gather by work item--> q_work [K, W, M, H]          (XLA, in the wrapper)
    q_work + kv_cache [2, K, P, S, H] --Pallas grid (K, W, steps)--> out_work [K, W, M, H]
    out_work --gather back by token--> out [T, N, H]                   (XLA, in the wrapper)

A work item is one query block of one request: request r's q_len tokens are cut into cdiv(q_len, Q)
blocks, so decode rows (q_len 1), chunked-prefill chunks and fresh prompts are all work items of the same
kernel. Re-laying q per work item keeps every Pallas block aligned, and each item writes only its own
rows, so a block never straddles two requests. W is static: sum_r cdiv(q_len_r, Q) <= (T + R * (Q - 1)) // Q.

GQA packing: an item's rows are (token, q head) pairs, row = token * G + g, so all G query heads of a kv
head share every K/V page DMA and one [M, H] x [H, pages_per_step * S] matmul.

Scalar prefetch (SMEM): query_start_loc [R + 1], seq_lens [R], block_tables flattened [R * max_blocks],
and the schedule work_request [W], work_block [W]. Every index_map and the kernel recompute an item's
geometry from them (`_Geometry`): its query positions, the first KV page it needs (the causal and
sliding-window span of its rows) and how many. Grid axis 2 walks that span pages_per_step pages at a
time; the K and V operands are passed n = pages_per_step times, operand i fetching page `step * n + i` of
the span through the block table. Steps past the span clamp to its last page, so the pipeline sees an
unchanged block index and issues no DMA, and the kernel skips their compute: only real pages are read.

Online softmax runs in VMEM scratch (m, l [M, 1], acc [M, H], float32) across the steps of one item; the
output block is written once, at the item's last step. NaN hygiene (unused pages may hold anything):
logits are masked with `where` to a finite value, probabilities of masked entries are selected to 0,
V rows outside the item's span are zeroed, and rows that saw no key (padding) divide by 1, not 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.layout import kv_cache_shape, write_kv

__all__ = ["TuningConfig", "kv_cache_shape", "ragged_paged_attention", "write_kv"]

# NOTE: finite, so `mask - mask` is 0 and not NaN; the same value JAX's TPU ragged kernel uses.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tuning knobs, passed statically (hashable). Semantics never depend on them.

    block_q: query tokens per work item. Rows per item are block_q * G (padded to the sublane tile);
      larger blocks re-read each KV page for fewer items (prefill), smaller ones waste fewer rows on
      decode items (q_len 1).
    pages_per_step: KV pages fetched and computed per grid step (the KV tile is pages_per_step * S
      tokens). More pages amortise the per-step overhead; a span shorter than a step fetches its last
      page more than once in that step.
    vmem_limit_bytes: Mosaic's scoped VMEM limit; None keeps the compiler default.
    """

    block_q: int = 16
    pages_per_step: int = 4
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        if not (isinstance(self.block_q, int) and self.block_q >= 1):
            raise ValueError(f"{self.block_q=} must be a positive int")
        if not (isinstance(self.pages_per_step, int) and 1 <= self.pages_per_step <= 64):
            raise ValueError(f"{self.pages_per_step=} must be an int in [1, 64]")
        if self.vmem_limit_bytes is not None and not (
            isinstance(self.vmem_limit_bytes, int) and self.vmem_limit_bytes >= 1 << 20
        ):
            raise ValueError(f"{self.vmem_limit_bytes=} must be None or an int of at least 1 MiB")


DEFAULT_CONFIG = TuningConfig()


class _Static(NamedTuple):
    """Shape facts every index_map and the kernel need, all Python ints."""

    group: int  # G
    block_q: int  # Q
    page_size: int  # S
    pages_per_step: int  # n
    max_blocks: int  # block-table width
    num_pages: int  # P
    sliding_window: int | None


class _Geometry(NamedTuple):
    """One work item, as traced int32 scalars read from the prefetched metadata."""

    request: Any
    num_tokens: Any  # real query tokens in this item (<= 0: padding item)
    first_pos: Any  # absolute position of the item's first query token
    kv_lo: Any  # first KV position any row may attend (0 without a window)
    kv_hi: Any  # one past the last KV position any row may attend
    first_page: Any  # logical page of kv_lo
    span_pages: Any  # logical pages the item reads; 0 when it reads none


def _geometry(w, query_start_loc_ref, seq_lens_ref, work_request_ref, work_block_ref, st: _Static):
    request = work_request_ref[w]
    q_start = query_start_loc_ref[request]
    q_len = query_start_loc_ref[request + 1] - q_start
    seq_len = seq_lens_ref[request]
    q_offset = work_block_ref[w] * st.block_q
    num_tokens = jnp.minimum(st.block_q, q_len - q_offset)
    first_pos = seq_len - q_len + q_offset
    kv_hi = jnp.minimum(first_pos + num_tokens, seq_len)
    if st.sliding_window is None:
        kv_lo = jnp.int32(0)
    else:
        kv_lo = jnp.maximum(first_pos - st.sliding_window + 1, 0)
    reads = (num_tokens > 0) & (kv_hi > kv_lo)
    first_page = lax.div(kv_lo, st.page_size)
    last_page = lax.div(jnp.maximum(kv_hi - 1, 0), st.page_size)
    span_pages = jnp.where(reads, last_page - first_page + 1, 0)
    return _Geometry(request, num_tokens, first_pos, kv_lo, kv_hi, first_page, span_pages)


def _kv_index_map(h, w, step, query_start_loc_ref, seq_lens_ref, block_tables_ref, work_request_ref,
                  work_block_ref, *, kv_index: int, slot: int, st: _Static):
    """Block index of page `step * n + slot` of item w's span, through the block table.

    Past the span end (and for padding items) the page clamps to the span's last page, which equals
    the previous step's block index, so the pipeline issues no new DMA.
    """
    g = _geometry(w, query_start_loc_ref, seq_lens_ref, work_request_ref, work_block_ref, st)
    page_in_span = jnp.minimum(step * st.pages_per_step + slot, jnp.maximum(g.span_pages - 1, 0))
    logical = jnp.minimum(g.first_page + page_in_span, st.max_blocks - 1)
    physical = block_tables_ref[g.request * st.max_blocks + logical]
    # NOTE: a padding item may read an unset block-table entry; clip so no DMA leaves the cache.
    physical = jnp.clip(physical, 0, st.num_pages - 1)
    return (kv_index, h, physical, 0, 0)


def _q_index_map(h, w, step, *prefetch_refs):
    del step, prefetch_refs
    return (h, w, 0, 0)


def _kernel(query_start_loc_ref, seq_lens_ref, block_tables_ref, work_request_ref, work_block_ref,
            q_ref, *refs, st: _Static, sm_scale: float):
    del block_tables_ref  # only the index_maps gather pages
    n = st.pages_per_step
    k_refs, v_refs = refs[:n], refs[n:2 * n]
    o_ref, m_scratch, l_scratch, acc_scratch = refs[2 * n:]
    w, step = pl.program_id(1), pl.program_id(2)
    g = _geometry(w, query_start_loc_ref, seq_lens_ref, work_request_ref, work_block_ref, st)

    @pl.when(step == 0)
    def _init():
        m_scratch[...] = jnp.full(m_scratch.shape, MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    @pl.when(step * n < g.span_pages)
    def _attend():
        q = q_ref[...]  # [M, H]
        k = jnp.concatenate([ref[...] for ref in k_refs], axis=0) if n > 1 else k_refs[0][...]  # [n*S, H]
        v = jnp.concatenate([ref[...] for ref in v_refs], axis=0) if n > 1 else v_refs[0][...]
        if k.dtype != q.dtype:
            k = k.astype(q.dtype)
        tile_start = (g.first_page + step * n) * st.page_size  # logical position of column 0

        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        scores = scores * sm_scale  # [M, n*S]
        row = lax.broadcasted_iota(jnp.int32, scores.shape, 0)
        token = lax.div(row, st.group) if st.group > 1 else row
        q_pos = g.first_pos + token  # <= seq_len - 1 for every real row, so causal implies in-sequence
        kv_pos = tile_start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        # NOTE: kv_pos is the unclamped logical position, so columns of a clamped (repeated) page
        # lie past kv_hi and fail the causal test; padding rows fail `token < num_tokens`.
        mask = (kv_pos <= q_pos) & (token < g.num_tokens)
        if st.sliding_window is not None:
            mask &= kv_pos > q_pos - st.sliding_window
        scores = jnp.where(mask, scores, MASK_VALUE)

        m_prev = m_scratch[...]  # [M, 1]
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
        probs = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_scratch[...] = m_next
        l_scratch[...] = alpha * l_scratch[...] + jnp.sum(probs, axis=1, keepdims=True)

        # V rows outside the item's span may be NaN (unused slots, freed pages): 0 * NaN is NaN.
        # The select runs in float32, as JAX's TPU ragged kernel does (no bf16 VPU before v6).
        v_pos = tile_start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where((v_pos >= g.kv_lo) & (v_pos < g.kv_hi), v.astype(jnp.float32), 0.0).astype(v.dtype)
        pv = jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_scratch[...] = alpha * acc_scratch[...] + pv

    @pl.when(step == pl.num_programs(2) - 1)
    def _finalize():
        l = l_scratch[...]
        o_ref[...] = (acc_scratch[...] / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)


def _sublane_tile(dtype) -> int:
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)  # 8 rows of f32, 16 of bf16, 32 of int8


def _check_shapes(q, kv_cache, query_start_loc, seq_lens, block_tables):
    if q.ndim != 3 or kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected q [T, N, H] and kv_cache [2, K, P, S, H] (layout.kv_cache_shape); got "
            f"q {q.shape} and kv_cache {kv_cache.shape}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != kv_cache head_dim {cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if page_size % _sublane_tile(kv_cache.dtype):
        raise ValueError(
            f"page size {page_size} must be a multiple of {_sublane_tile(kv_cache.dtype)} for a "
            f"{kv_cache.dtype} cache (TPU sublane tiling: pages are concatenated into one KV tile)"
        )
    num_reqs, _ = block_tables.shape
    if query_start_loc.shape != (num_reqs + 1,) or seq_lens.shape != (num_reqs,):
        raise ValueError(
            f"expected query_start_loc [R + 1] and seq_lens [R] for R = {num_reqs} block-table rows; got "
            f"{query_start_loc.shape} and {seq_lens.shape}"
        )


def _schedule(query_start_loc, num_work: int, block_q: int):
    """Work items in request order: work_request [W] and work_block [W] (query block within the request).

    Items past the last real one get request R - 1 and a block index past its end (num_tokens <= 0).
    """
    q_lens = jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    blocks_end = jnp.cumsum(blocks)
    blocks_start = blocks_end - blocks
    work = jnp.arange(num_work, dtype=jnp.int32)
    work_request = jnp.searchsorted(blocks_end, work, side="right").astype(jnp.int32)
    work_request = jnp.minimum(work_request, q_lens.shape[0] - 1)
    work_block = (work - blocks_start[work_request]).astype(jnp.int32)
    return work_request, work_block, blocks_start


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
    interpret: bool | pltpu.InterpretParams = False,
    config: TuningConfig | None = None,
    decode_only: bool = False,
) -> jax.Array:
    """Ragged query rows attending over their requests' paged KV; see `reference.ragged_paged_attention`.

    interpret: True (HLO interpreter) or `pltpu.InterpretParams()` (TPU simulator) to run on CPU.
    decode_only: the GPU kernel's fast-path hint (one query token per request); this kernel's grid
    already skips finished rows, so it takes the one path either way.
    """
    del decode_only
    config = DEFAULT_CONFIG if config is None else config
    _check_shapes(q, kv_cache, query_start_loc, seq_lens, block_tables)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or >= 1")
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = kv_cache.shape
    num_reqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    block_q = config.block_q
    pages_per_step = config.pages_per_step
    rows = block_q * group
    rows_padded = pl.cdiv(rows, _sublane_tile(q.dtype)) * _sublane_tile(q.dtype)
    num_work = max(1, (num_tokens + num_reqs * (block_q - 1)) // block_q)

    # Longest page span of one item: its rows cover block_q positions, each attending `window` back.
    max_span_pages = max_blocks
    if sliding_window is not None:
        span_tokens = block_q - 1 + sliding_window
        max_span_pages = min(max_blocks, (span_tokens + page_size - 2) // page_size + 1)
    # NOTE: every item walks num_steps grid steps (the longest possible span); skipped steps cost
    # only per-step overhead, but a flattened (item, page) schedule or a manual-DMA loop would drop them.
    num_steps = pl.cdiv(max_span_pages, pages_per_step)

    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    work_request, work_block, blocks_start = _schedule(query_start_loc, num_work, block_q)

    # q [T, N, H] -> q_work [K, W, M, H], rows ordered (token, q head) within an item.
    token_of_row = (query_start_loc[work_request] + work_block * block_q)[:, None] + jnp.arange(block_q)
    token_of_row = jnp.clip(token_of_row, 0, num_tokens - 1).reshape(-1)  # [W * Q]
    q_work = q.reshape(num_tokens, num_kv_heads, group, head_dim)[token_of_row]  # [W*Q, K, G, H]
    q_work = q_work.reshape(num_work, block_q, num_kv_heads, group, head_dim).transpose(2, 0, 1, 3, 4)
    q_work = q_work.reshape(num_kv_heads, num_work, rows, head_dim)
    if rows_padded != rows:
        q_work = jnp.pad(q_work, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))

    st = _Static(group, block_q, page_size, pages_per_step, max_blocks, num_pages, sliding_window)
    page_block = (None, None, None, page_size, head_dim)
    kv_specs = [
        pl.BlockSpec(page_block, functools.partial(_kv_index_map, kv_index=kv_index, slot=slot, st=st))
        for kv_index in (0, 1)
        for slot in range(pages_per_step)
    ]
    item_spec = pl.BlockSpec((None, None, rows_padded, head_dim), _q_index_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_kv_heads, num_work, num_steps),
        in_specs=[item_spec, *kv_specs],
        out_specs=item_spec,
        scratch_shapes=[
            pltpu.VMEM((rows_padded, 1), jnp.float32),  # running max m
            pltpu.VMEM((rows_padded, 1), jnp.float32),  # running denominator l
            pltpu.VMEM((rows_padded, head_dim), jnp.float32),  # unnormalised output acc
        ],
    )
    kv_tokens = num_kv_heads * num_work * num_steps * pages_per_step * page_size
    kv_bytes = 2 * kv_tokens * head_dim * kv_cache.dtype.itemsize
    flops = 4 * kv_tokens * rows_padded * head_dim
    out_work = pl.pallas_call(
        functools.partial(_kernel, st=st, sm_scale=float(sm_scale)),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_work, rows_padded, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=config.vmem_limit_bytes,
        ),
        # NOTE: an upper bound (every step of every item); real work skips clamped steps.
        cost_estimate=pl.CostEstimate(
            flops=flops, transcendentals=flops // (4 * head_dim),
            bytes_accessed=kv_bytes + 2 * q_work.size * q.dtype.itemsize,
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(query_start_loc, seq_lens, block_tables.reshape(-1), work_request, work_block,
      q_work, *([kv_cache] * (2 * pages_per_step)))

    # out_work [K, W, M, H] -> out [T, N, H]: token t of request r sits in item blocks_start[r] + j, row i.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    request = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), num_reqs - 1)
    local = token - query_start_loc[request]
    item_row = (blocks_start[request] + local // block_q) * block_q + local % block_q
    item_row = jnp.clip(item_row, 0, num_work * block_q - 1)
    out = out_work[:, :, :rows].reshape(num_kv_heads, num_work * block_q, group, head_dim)[:, item_row]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    valid = token < query_start_loc[num_reqs]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))
