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


def to_reference_layout(kv_cache: jax.Array) -> jax.Array:
    """[2, K, P, S, H] -> the reference's [2, P, S, K, H] (tests compare kernels to the reference)."""
    return kv_cache.transpose(0, 2, 3, 1, 4)
