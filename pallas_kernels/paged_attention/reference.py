"""Pure-jnp ragged paged attention: the reference every kernel is tested against.

Data flow of one call (dimension letters as in `jaxserve/models/layers.py`):

    new k, v [T, K, H] --write_kv(slot_mapping)--> kv_cache [2, P, S, K, H]
    q [T, N, H] + kv_cache + (query_start_loc, seq_lens, block_tables) --> out [T, N, H]

The token batch is flattened and ragged: request r owns query rows
`query_start_loc[r] : query_start_loc[r + 1]`, which are its LAST q_len tokens, so the query row
i of request r sits at absolute position `seq_lens[r] - q_len + i` and attends causally to the
request's KV positions 0..that position (and only the last `sliding_window` of them when a window
is set). Decode rows (q_len 1), chunked-prefill rows and fresh prompts are the same case.

Padding: rows past `query_start_loc[-1]` and requests with `seq_lens == 0` produce zeros.
Padding tokens write their K/V to slot 0..S-1 of the null block 0, which is never read unmasked.
Cache pages that no block table reaches may hold anything (tests fill them with NaN): masked
entries are selected away with `where`, never multiplied by zero.

FP8 caches (float8_e4m3fn, `fp8.py`): `kv_scale` [2, K] float32 holds the K and V scales of each kv
head (None: 1). The write quantizes; attention reads the fp8 values in q's dtype (exactly: every
float8_e4m3fn value is a bfloat16 one), scales the scores by K's scale and the output by V's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import fp8

# NOTE: the cache layout is owned by the attention backend. This reference keeps K and V of a
# layer in one array so a layer's cache is one donated buffer: [2, P, S, K, H].


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             kv_scale: jax.Array | None = None) -> jax.Array:
    """Scatter new K/V rows into their slots. k, v: [T, K, H]; slot_mapping: [T] = block * S + offset.
    An fp8 cache stores them quantized by `kv_scale` [2, K] (None: 1)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)
    kv = jnp.stack([k, v])  # [2, T, K, H]
    if fp8.is_fp8(kv_cache.dtype):
        kv = fp8.quantize(kv, None if kv_scale is None else kv_scale[:, None, :, None])
    kv = kv.astype(kv_cache.dtype)
    flat = flat.at[:, slot_mapping].set(kv, mode="drop")
    return flat.reshape(kv_cache.shape)


def gather_kv(kv_cache: jax.Array, block_table: jax.Array, seq_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One request's K and V in token order through its block-table row [max_blocks]: each
    [1, max_blocks * S, K, H] in the cache's dtype, zeros at positions >= seq_len (the flash prefill's
    input: jaxserve/models/layers.py)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    kv = kv_cache[:, block_table].reshape(2, block_table.shape[0] * block_size, num_kv_heads, head_dim)
    valid = jnp.arange(kv.shape[1]) < seq_len
    kv = jnp.where(valid[None, :, None, None], kv, jnp.zeros((), kv.dtype))
    return kv[0][None], kv[1][None]


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, P, S, K, H]
    query_start_loc: jax.Array,  # [R + 1] int32
    seq_lens: jax.Array,  # [R] int32, tokens in the cache for each request, including this step's
    block_tables: jax.Array,  # [R, max_blocks] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    decode_only: bool = False,  # the kernels' fast-path hint (one query token per request); same result
    kv_scale: jax.Array | None = None,  # [2, K] float32, an fp8 cache's scales (None: 1)
) -> jax.Array:
    del decode_only
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    num_reqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    max_len = max_blocks * block_size

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(query_start_loc[1:], token, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_reqs - 1)
    start = query_start_loc[req]
    q_len = query_start_loc[req + 1] - start
    valid_token = token < query_start_loc[num_reqs]
    q_pos = seq_lens[req] - q_len + (token - start)  # [T] absolute position of each query row

    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < seq_lens[req][:, None])
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    mask &= valid_token[:, None]  # [T, L]

    # Gather each request's pages: [R, max_blocks, S, K, H] -> [R, L, K, H], then per token.
    quantized = fp8.is_fp8(kv_cache.dtype)
    k = kv_cache[0][block_tables].reshape(num_reqs, max_len, num_kv_heads, head_dim)[req]
    v = kv_cache[1][block_tables].reshape(num_reqs, max_len, num_kv_heads, head_dim)[req]
    if quantized:  # the scales are applied after the dots; fp8 -> q's dtype is exact
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    v = jnp.where(mask[:, :, None, None], v, 0)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgh,tlkh->tkgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if quantized and kv_scale is not None:
        scores = scores * kv_scale[0][None, :, None, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("tkgl,tlkh->tkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    if quantized and kv_scale is not None:
        out = out * kv_scale[1][None, :, None, None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
