"""Pure-jnp causal GQA attention over a padded batch: the ground truth for `flash_attention`.

    q [B, Tq, N, H], k/v [B, Tkv, K, H], seq_lens [B], q_offset [B] (both optional) --> out [B, Tq, N, H]

Query head n reads kv head n // G (G = N // K). Row i of sequence b sits at absolute position
p = q_offset[b] + i (q_offset None: 0, and then Tq == Tkv: a fresh prompt) and attends to keys 0..p
(causal) that are also below `seq_lens[b]` (None: Tkv): a chunk of a long prompt whose earlier
chunks' K/V lead k and v. Rows at positions >= seq_lens[b] are padding and come out as zeros. Keys and
values past `seq_lens[b]` may hold anything (tests fill them with NaN): they are selected away with
`where`, never multiplied by zero. Scores and softmax run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def flash_attention_reference(
    q: jax.Array,  # [B, Tq, N, H]
    k: jax.Array,  # [B, Tkv, K, H]
    v: jax.Array,  # [B, Tkv, K, H]
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    seq_lens: jax.Array | None = None,  # [B] int32, valid keys
    q_offset: jax.Array | None = None,  # [B] int32, the position of q's row 0
) -> jax.Array:
    batch, num_tokens, num_q_heads, head_dim = q.shape
    kv_tokens, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    if seq_lens is None:
        seq_lens = jnp.full((batch,), kv_tokens, jnp.int32)
    if q_offset is None:
        q_offset = jnp.zeros((batch,), jnp.int32)

    q32 = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q32, k32, precision="highest") * sm_scale

    q_pos = q_offset[:, None] + jnp.arange(num_tokens)[None, :]  # [B, Tq]
    kv_pos = jnp.arange(kv_tokens)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]  # [B, Tkv]
    q_valid = q_pos < seq_lens[:, None]  # [B, Tq]
    mask = kv_valid[:, None, :] & q_valid[:, :, None]  # [B, Tq, Tkv]
    if causal:
        mask &= q_pos[:, :, None] >= kv_pos[None, None, :]
    mask = mask[:, None, None]  # [B, 1, 1, Tq, Tkv]
    scores = jnp.where(mask, scores, -jnp.inf)
    weights = jax.nn.softmax(jnp.where(mask.any(-1, keepdims=True), scores, 0.0), axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    v32 = jnp.where(kv_valid[:, :, None, None], v32, 0.0)
    out = jnp.einsum("bkgqs,bskh->bqkgh", weights, v32, precision="highest")
    out = jnp.where(q_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, num_tokens, num_q_heads, head_dim).astype(q.dtype)
