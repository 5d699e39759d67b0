"""Pure-jnp causal GQA attention over a padded batch: the ground truth for `flash_attention`.

    q [B, T, N, H], k/v [B, T, K, H], seq_lens [B] (optional) --> out [B, T, N, H]

Query head n reads kv head n // G (G = N // K). Row t of sequence b attends to keys
0..t (causal) that are also below `seq_lens[b]`; rows t >= seq_lens[b] are padding and come out
as zeros. Keys and values past `seq_lens[b]` may hold anything (tests fill them with NaN): they
are selected away with `where`, never multiplied by zero. Scores and softmax run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def flash_attention_reference(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, T, K, H]
    v: jax.Array,  # [B, T, K, H]
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    seq_lens: jax.Array | None = None,  # [B] int32
) -> jax.Array:
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    if seq_lens is None:
        seq_lens = jnp.full((batch,), num_tokens, jnp.int32)

    q32 = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q32, k32, precision="highest") * sm_scale

    pos = jnp.arange(num_tokens)
    q_valid = pos[None, :] < seq_lens[:, None]  # [B, T]
    mask = (pos[None, None, :] < seq_lens[:, None, None]) & q_valid[:, :, None]  # [B, Tq, Tk]
    if causal:
        mask &= pos[:, None] >= pos[None, :]
    mask = mask[:, None, None]  # [B, 1, 1, Tq, Tk]
    scores = jnp.where(mask, scores, -jnp.inf)
    weights = jax.nn.softmax(jnp.where(mask.any(-1, keepdims=True), scores, 0.0), axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    v32 = jnp.where((pos[None, :] < seq_lens[:, None])[:, :, None, None], v32, 0.0)
    out = jnp.einsum("bkgqs,bskh->bqkgh", weights, v32, precision="highest")
    out = jnp.where(q_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, num_tokens, num_q_heads, head_dim).astype(q.dtype)
