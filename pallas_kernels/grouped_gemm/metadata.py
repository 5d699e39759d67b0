"""Work lists for the grouped GEMM kernels, built from `group_sizes` with jnp ops (traced, on device).

Rows are sorted by group: group g owns rows [offsets[g], offsets[g + 1]). The rows past
sum(group_sizes) form one more pseudo-group, id G (the number of real groups), which the kernels
write as zeros, so every output row is written by exactly one work item's store and no pass over the
output is needed afterwards. Empty groups own no work item: a kernel's grid (or its persistent loop)
runs only over `num_items`, so experts no row was routed to cost nothing.

Two tilings:
  * `group_tiles` (GPU): each group is cut into tiles of at most `block_m` rows that start at the
    group's own first row; a tile never holds two groups, so its store covers only its own rows.
  * `aligned_tiles` (TPU, megablox-style): tiles on a fixed `block_m` grid of the rows; a tile that
    holds the boundary between groups is visited once per group, in consecutive grid steps, and each
    visit stores only its group's rows (the output block stays resident between them).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _offsets(group_sizes, m: int):
    """Row starts of the G real groups and the tail pseudo-group, and the sizes of all G + 1."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    tail = jnp.maximum(jnp.int32(m) - ends[-1], 0)
    sizes = jnp.concatenate([sizes, tail[None]])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return starts, sizes


def _expand(counts, max_items: int):
    """For items 0..max_items-1 laid out group after group (`counts[g]` items for group g): each item's
    group and its index inside the group. Items past the total get the last group and index 0."""
    cum = jnp.cumsum(counts)
    item = jnp.arange(max_items, dtype=jnp.int32)
    group = jnp.sum(cum[None, :] <= item[:, None], axis=1).astype(jnp.int32)
    valid = item < cum[-1]
    group = jnp.where(valid, group, counts.shape[0] - 1)
    index = jnp.where(valid, item - (cum[group] - counts[group]), 0)
    return group, index, cum[-1].astype(jnp.int32)


def max_group_tiles(m: int, num_groups: int, block_m: int, align: int = 8) -> int:
    """An upper bound on `group_tiles`' item count: group g takes ceil((size + start % align) / b)
    <= (size + align - 1) / b + 1 tiles, for each of the G + 1 (pseudo-)groups; no tile is empty."""
    return max(1, min((m + (align - 1) * (num_groups + 1)) // block_m + num_groups + 2, m))


def group_tiles(group_sizes, m: int, block_m: int, align: int = 8):
    """GPU work list. Returns (num_items [1], group [I], start [I], rows [I]) int32, I =
    max_group_tiles(...): item i covers rows [start[i], start[i] + rows[i]) of group[i] (G: zeros).

    A group's tiles lie on windows of block_m rows from its first row rounded down to `align`, so
    every tile's rows sit inside the block_m rows from its start rounded down to `align` (the Mosaic
    kernel's row loads start on a multiple of its SMEM tiling)."""
    starts, sizes = _offsets(group_sizes, m)
    ends = starts + sizes
    base = starts - starts % align
    counts = jnp.where(sizes > 0, (ends - base + block_m - 1) // block_m, 0)
    group, index, num = _expand(counts, max_group_tiles(m, group_sizes.shape[0], block_m, align))
    window = base[group] + index * block_m
    start = jnp.maximum(starts[group], window)
    rows = jnp.minimum(ends[group], window + block_m) - start
    valid = jnp.arange(group.shape[0]) < num
    return num[None], group, jnp.where(valid, start, 0), jnp.where(valid, rows, 0)


def max_aligned_tiles(m: int, num_groups: int, block_m: int) -> int:
    """An upper bound on `aligned_tiles`' item count: every row tile once, plus one revisit per
    group boundary that falls inside a tile."""
    return -(-m // block_m) + num_groups


def aligned_tiles(group_sizes, m: int, block_m: int):
    """TPU work list on the fixed row-tile grid (m a multiple of block_m). Returns (num_items [1],
    group [I], m_tile [I], bounds [G + 2]) int32: item i is row tile m_tile[i] restricted to the rows
    [bounds[g], bounds[g + 1]) of g = group[i]; m_tile never decreases along the items."""
    starts, sizes = _offsets(group_sizes, m)
    ends = starts + sizes
    first = starts // block_m
    counts = jnp.where(sizes > 0, (ends + block_m - 1) // block_m - first, 0)
    group, index, num = _expand(counts, max_aligned_tiles(m, group_sizes.shape[0], block_m))
    m_tile = jnp.minimum(first[group] + index, m // block_m - 1)
    bounds = jnp.concatenate([starts, ends[-1:]])
    return num[None], group, m_tile, bounds


def group_tiles_numpy(group_sizes, m: int, block_m: int, align: int = 8):
    """`group_tiles` in plain Python, for tests: [(group, start, rows), ...] without padding."""
    items, start = [], 0
    sizes = [int(s) for s in group_sizes] + [max(m - int(np.sum(group_sizes)), 0)]
    for g, size in enumerate(sizes):
        window = start - start % align
        while size and window < start + size:
            lo, hi = max(start, window), min(start + size, window + block_m)
            items.append((g, lo, hi - lo))
            window += block_m
        start += size
    return items
