"""Model building blocks shared by every architecture: RMSNorm, rotary embeddings, the attention
dispatch point, the gated MLP.

Dimension alphabet (used in einsum strings, comments and docstrings across the project):
    B batch, T tokens (flattened ragged batch), D model width, N query heads, K kv heads,
    G query heads per kv head (N // K), H head dim, F feed-forward width, V vocabulary,
    P pages (blocks), S page size (block size), L kv length, R requests, E experts.

Numerics follow Hugging Face transformers (the correctness reference): norms, rotary tables,
attention scores and logits are computed in float32; matmuls run in the parameter dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import quant
from pallas_kernels.paged_attention import fp8
from pallas_kernels.paged_attention import reference as reference_attention


class ModelBatch(NamedTuple):
    """The flattened ragged token batch of one step (docs/ARCHITECTURE.md §2.1). T and R are padded to buckets."""

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, absolute position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, block * S + offset where the token's K/V is written
    query_start_loc: jax.Array  # [R + 1] int32
    seq_lens: jax.Array  # [R] int32, tokens in the cache after this step (0 for padding requests)
    block_tables: jax.Array  # [R, max_blocks] int32
    logits_indices: jax.Array  # [num_logits] int32, which token rows need logits


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] -> [..., D]; statistics in float32, output in x's dtype scaled by weight."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple[tuple[str, object], ...] | None) -> np.ndarray:
    """Inverse frequencies [H // 2] in float32, computed on the host the way transformers does.

    `scaling` is the (hashable) rope-scaling dict: None / default, "linear" or "llama3".
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    params = dict(scaling or ())
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / np.float32(params["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = np.float32(params["factor"])
        low_freq_factor = np.float32(params["low_freq_factor"])
        high_freq_factor = np.float32(params["high_freq_factor"])
        old_context_len = np.float32(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half rotary embedding (HF convention). x [T, heads, H], positions [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, H/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def gated_mlp(x: jax.Array, *weights, gate_up_biases=None) -> jax.Array:
    """SwiGLU: down(silu(x @ gate) * (x @ up)). x [T, D]; weights (w_gate, w_up [D, F], w_down [F, D]), or
    (w_gate_up, w_down): gate's and up's FP8 weights joined into one [D, 2F] (quant.fuse_outputs).

    Inside shard_map the weights hold F/tp columns (gate/up column-parallel, down row-parallel), so
    the result is this device's partial sum: the caller all-reduces it, then adds the down bias. Weights
    may be FP8 (quant.linear)."""
    *gate_up, w_down = weights
    if len(gate_up) == 1:
        gate, up = jnp.split(quant.linear(x, gate_up[0]), 2, axis=-1)
    else:
        gate = quant.linear(x, gate_up[0], "td,df->tf")
        up = quant.linear(x, gate_up[1], "td,df->tf")
    if gate_up_biases is not None:
        gate, up = gate + gate_up_biases[0], up + gate_up_biases[1]
    return quant.linear(jax.nn.silu(gate) * up, w_down, "tf,fd->td")


ATTENTION_BACKENDS = ("reference", "pallas")


def attention_backend(name: str):
    """The module implementing `kv_cache_shape`, `write_kv` and `ragged_paged_attention`.

    "pallas" picks the kernel for the default platform: Triton on GPU, Mosaic on TPU.
    """
    if name == "reference":
        return reference_attention
    if name == "pallas":
        platform = jax.default_backend()
        if platform == "gpu":
            from pallas_kernels.paged_attention import gpu
            return gpu
        if platform == "tpu":
            from pallas_kernels.paged_attention import tpu
            return tpu
        raise ValueError(f"attention_backend 'pallas' needs a GPU or TPU, but JAX runs on {platform!r}; "
                         "use 'reference' (or 'auto')")
    raise ValueError(f"unknown attention_backend {name!r}; choose one of {list(ATTENTION_BACKENDS)}")


def kv_cache_axes(name: str) -> tuple[str | None, ...]:
    """Logical axes of one layer's cache array in backend `name`'s layout ("kv_heads" is what tensor
    parallelism shards), read off the backend's own `kv_cache_shape` so the layout stays its own."""
    probe = {"pages": 3, "page_slots": 5, "kv_heads": 7, "head_dim": 11}  # distinct sizes; the K/V axis is 2
    shape = attention_backend(name).kv_cache_shape(probe["pages"], probe["page_slots"], probe["kv_heads"],
                                                   probe["head_dim"])
    by_size = {size: axis for axis, size in probe.items()}
    return tuple(by_size.get(size) for size in shape)


def paged_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_cache: jax.Array,
    batch: ModelBatch,
    *,
    sm_scale: float,
    sliding_window: int | None,
    backend: str,
    decode_only: bool = False,
    kv_scale: jax.Array | None = None,
    flash_prefill_threshold: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The single attention dispatch point: write this step's K/V, then attend through block tables.

    `decode_only` (static): every request of the batch has exactly one query token, token r being
    request r's; the GPU kernel then skips its general (prefill) path. An fp8 cache (the cache's dtype
    says it) stores K/V quantized by `kv_scale` [2, K] float32 (its K and V scale per kv head; None: 1;
    pallas_kernels/paged_attention/fp8.py); a cache in a float dtype ignores it.

    `flash_prefill_threshold` (static; 0: off; runner.flash_prefill_token_threshold): a step of at least
    that many tokens, where `flash_prefill_fn` has a flash attention for the backend, compiles a long-prefill
    variant. When one request holds at least that many of the step's query rows (checked on the device),
    its rows run the flash attention over its K/V gathered from the cache (`_long_request_attention`) and
    the ragged kernel skips them (its seq_len set to 0 there: no work, zeros); other steps run as without
    the option."""
    impl = attention_backend(backend)
    scale = {"kv_scale": kv_scale} if fp8.is_fp8(kv_cache.dtype) else {}
    kv_cache = impl.write_kv(kv_cache, k, v, batch.slot_mapping, **scale)
    flash = None
    if flash_prefill_threshold > 0 and not decode_only and q.shape[0] >= flash_prefill_threshold:
        flash = flash_prefill_fn(backend, sliding_window)
    seq_lens = batch.seq_lens
    if flash is not None:
        q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
        longest = jnp.argmax(q_lens).astype(jnp.int32)
        is_long = q_lens[longest] >= flash_prefill_threshold
        seq_lens = jnp.where(is_long & (jnp.arange(seq_lens.shape[0]) == longest), 0, seq_lens)
    out = impl.ragged_paged_attention(
        q, kv_cache, batch.query_start_loc, seq_lens, batch.block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window, decode_only=decode_only, **scale,
    )
    if flash is not None:
        out = jax.lax.cond(
            is_long, lambda: _long_request_attention(q, kv_cache, batch, longest, out, gather_kv=impl.gather_kv,
                                                     flash=flash, sm_scale=sm_scale, kv_scale=kv_scale),
            lambda: out)
    return out, kv_cache


def flash_prefill_fn(backend: str, sliding_window: int | None):
    """The flash attention a long request's prefill runs with `backend`'s cache, or None where there is
    none: the flash kernels (pallas_kernels/flash_attention: Mosaic GPU on Hopper, Triton elsewhere) with
    the GPU "pallas" backend, their jnp reference with "reference" (CPU tests), none on TPU or with a
    sliding window (the flash kernels have none). An fp8 cache's K/V are dequantized as they are gathered."""
    if sliding_window is not None:
        return None
    if backend == "reference":
        from pallas_kernels.flash_attention.reference import flash_attention_reference
        return flash_attention_reference
    if backend == "pallas" and jax.default_backend() == "gpu":
        from pallas_kernels.flash_attention import flash_attention
        return flash_attention
    return None


def _long_request_attention(q, kv_cache, batch: ModelBatch, req: jax.Array, out: jax.Array, *, gather_kv,
                            flash, sm_scale: float, kv_scale: jax.Array | None = None) -> jax.Array:
    """`out` [T, N, H] with request `req`'s rows replaced by flash attention over its cached K/V.

    The request's K/V come from the cache (this step's rows already written) through its block-table
    row: [1, max_blocks * S, K, H], zeros past its seq_len. Its q_len rows, rotated to the front of q
    (static length T; the rows after them are other requests' or padding, computed and dropped), sit at
    positions seq_len - q_len + i. An fp8 cache's K/V are multiplied by `kv_scale` [2, K] (None: 1) in
    float32 and rounded to q's dtype, as the ragged kernel widens them."""
    num_tokens = q.shape[0]
    start = batch.query_start_loc[req]
    q_len = batch.query_start_loc[req + 1] - start
    seq_len = batch.seq_lens[req]
    k, v = gather_kv(kv_cache, batch.block_tables[req], seq_len)
    if fp8.is_fp8(kv_cache.dtype) and kv_scale is not None:
        scales = kv_scale.astype(jnp.float32).reshape(2, 1, 1, -1, 1)
        k, v = k.astype(jnp.float32) * scales[0], v.astype(jnp.float32) * scales[1]
    rows = jnp.roll(q, -start, axis=0)[None]  # [1, T, N, H], the request's rows first
    flash_out = flash(rows, k.astype(q.dtype), v.astype(q.dtype), sm_scale=sm_scale,
                      q_offset=(seq_len - q_len)[None])[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    mine = (token >= start) & (token < start + q_len)
    return jnp.where(mine[:, None, None], jnp.roll(flash_out, start, axis=0), out)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float,
                     sliding_window: int | None = None) -> jax.Array:
    """Dense causal attention for training and tests. q [B, T, N, H], k, v [B, T, K, H]."""
    batch, length, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.reshape(batch, length, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    pos = jnp.arange(length)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, length, num_q_heads, head_dim).astype(q.dtype)
