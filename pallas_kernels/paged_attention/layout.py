"""The KV cache layout shared by the Pallas paged-attention kernels (GPU Triton and TPU Mosaic).

    kv_cache [2, K, P, S, H]: K/V, kv head, page, slot in page, head dim ("heads-major pages")

One kv head's page is a contiguous [S, H] tile, so a kernel program that owns one kv head (all
its G query heads packed together) reads each page with one contiguous load or DMA, and the last
two dims (S, H) satisfy the TPU (8, 128) tiling for S % 8 == 0 and H % 128 == 0 (or H the full dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import fp8


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             kv_scale: jax.Array | None = None) -> jax.Array:
    """Scatter new K/V rows [T, K, H] into slots (block * S + offset) of every kv head's pages. An fp8
    cache stores them quantized by `kv_scale` [2, K] (None: 1; fp8.py)."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    flat = kv_cache.reshape(2, num_kv_heads, num_blocks * block_size, head_dim)
    kv = jnp.stack([k, v])  # [2, T, K, H]
    if fp8.is_fp8(kv_cache.dtype):
        kv = fp8.quantize(kv, None if kv_scale is None else kv_scale[:, None, :, None])
    kv = kv.astype(kv_cache.dtype).transpose(0, 2, 1, 3)  # [2, K, T, H]
    flat = flat.at[:, :, slot_mapping].set(kv, mode="drop")
    return flat.reshape(kv_cache.shape)


def gather_kv(kv_cache: jax.Array, block_table: jax.Array, seq_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One request's K and V in token order through its block-table row [max_blocks]: each
    [1, max_blocks * S, K, H] in the cache's dtype (token-major, as the flash kernels read them), zeros at
    positions >= seq_len. One gather + transpose fusion: the request's pages are read once."""
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    kv = kv_cache[:, :, block_table]  # [2, K, max_blocks, S, H]
    kv = kv.reshape(2, num_kv_heads, block_table.shape[0] * block_size, head_dim).transpose(0, 2, 1, 3)
    valid = jnp.arange(kv.shape[1]) < seq_len
    kv = jnp.where(valid[None, :, None, None], kv, jnp.zeros((), kv.dtype))
    return kv[0][None], kv[1][None]


def to_reference_layout(kv_cache: jax.Array) -> jax.Array:
    """[2, K, P, S, H] -> the reference's [2, P, S, K, H] (tests compare kernels to the reference)."""
    return kv_cache.transpose(0, 2, 3, 1, 4)
