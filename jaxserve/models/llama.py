"""Llama-family decoder: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), with GQA and tied or untied embeddings — one module, config switches.

Params are a pytree of nested dicts; weights are stored in `x @ W` orientation with heads split
out (wq [D, N, H], wo [N, H, D]) so every matmul is an einsum in the dimension alphabet of
layers.py. `abstract(cfg)` declares every tensor's shape once; the loader and tests build on it.

    forward(params, cfg, batch, kv_caches) -> (logits [num_logits, V] float32, kv_caches)

Layers are unrolled in Python with one cache array per layer (a list), donated by the caller's
jit: measured on the H200, this ran 2.8x faster than `lax.scan` over stacked layers (DESIGN §2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models import layers
from jaxserve.models.layers import ModelBatch

Params = dict[str, Any]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable form of HF's rope dict
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None  # Mistral
    dtype: str = "bfloat16"
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]


def abstract(cfg: LlamaConfig) -> Params:
    """Shape and dtype of every parameter, as jax.ShapeDtypeStruct leaves."""
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, cfg.jnp_dtype)

    layer = {
        "attn_norm": s(d), "wq": s(d, n, h), "wk": s(d, k, h), "wv": s(d, k, h), "wo": s(n, h, d),
        "mlp_norm": s(d), "w_gate": s(d, f), "w_up": s(d, f), "w_down": s(f, d),
    }
    if cfg.qkv_bias:
        layer |= {"bq": s(n, h), "bk": s(k, h), "bv": s(k, h)}
    if cfg.o_bias:
        layer["bo"] = s(d)
    if cfg.mlp_bias:
        layer |= {"b_gate": s(f), "b_up": s(f), "b_down": s(d)}
    if cfg.qk_norm:
        layer |= {"q_norm": s(h), "k_norm": s(h)}
    params: Params = {"embed": s(v, d), "layers": [dict(layer) for _ in range(cfg.num_layers)],
                      "final_norm": s(d)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = s(d, v)
    return params


def init_params(cfg: LlamaConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random parameters (training from scratch and tests): normal weights, unit norms, zero biases."""
    leaves, treedef = jax.tree.flatten_with_path(abstract(cfg))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), leaf_key in zip(leaves, keys):
        name = str(path[-1].key)
        if name.endswith("norm"):
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        elif name.startswith("b"):
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            out.append((std * jax.random.normal(leaf_key, leaf.shape, jnp.float32)).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, out)


def _qkv(lp: Params, cfg: LlamaConfig, x: jax.Array, positions: jax.Array, inv_freq):
    """x [T, D] -> q [T, N, H], k, v [T, K, H] with bias, q/k norm and rope applied."""
    q = jnp.einsum("td,dnh->tnh", x, lp["wq"])
    k = jnp.einsum("td,dkh->tkh", x, lp["wk"])
    v = jnp.einsum("td,dkh->tkh", x, lp["wv"])
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if cfg.qk_norm:
        q = layers.rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = layers.rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq), v


def _out_and_mlp(lp: Params, cfg: LlamaConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Attention output projection + residual, then the MLP block + residual. x [T, D]."""
    # NOTE: a 2-D matmul over the flattened (N, H) axis; einsum "tnh,nhd->td" made XLA relayout
    # (copy) the whole wo weight every step.
    num_heads, head_dim, width = lp["wo"].shape
    o = attn.reshape(-1, num_heads * head_dim) @ lp["wo"].reshape(num_heads * head_dim, width)
    if cfg.o_bias:
        o = o + lp["bo"]
    x = x + o
    h = layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    biases = (lp["b_gate"], lp["b_up"], lp["b_down"]) if cfg.mlp_bias else None
    return x + layers.gated_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"], biases)


def _logits(params: Params, cfg: LlamaConfig, x: jax.Array) -> jax.Array:
    x = layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        return jnp.einsum("...d,vd->...v", x, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


def forward(
    params: Params,
    cfg: LlamaConfig,
    batch: ModelBatch,
    kv_caches: list[jax.Array],
    attention_backend: str = "reference",
) -> tuple[jax.Array, list[jax.Array]]:
    """One engine step over the ragged batch. Returns float32 logits for `batch.logits_indices`."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    sm_scale = cfg.head_dim ** -0.5
    x = params["embed"][batch.token_ids]  # [T, D]
    new_caches = []
    for lp, kv_cache in zip(params["layers"], kv_caches):
        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(lp, cfg, h, batch.positions, inv_freq)
        attn, kv_cache = layers.paged_attention(
            q, k, v, kv_cache, batch, sm_scale=sm_scale, sliding_window=cfg.sliding_window,
            backend=attention_backend,
        )
        new_caches.append(kv_cache)
        x = _out_and_mlp(lp, cfg, x, attn)
    return _logits(params, cfg, x[batch.logits_indices]), new_caches


def forward_dense(params: Params, cfg: LlamaConfig, token_ids: jax.Array) -> jax.Array:
    """Cache-free causal forward for training and tests: token_ids [B, T] -> logits [B, T, V]."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    batch, length = token_ids.shape
    positions = jnp.arange(length, dtype=jnp.int32)
    x = params["embed"][token_ids.reshape(-1)]  # [B*T, D]
    for lp in params["layers"]:
        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(lp, cfg, h, jnp.tile(positions, batch), inv_freq)
        attn = layers.causal_attention(
            q.reshape(batch, length, *q.shape[1:]), k.reshape(batch, length, *k.shape[1:]),
            v.reshape(batch, length, *v.shape[1:]), sm_scale=cfg.head_dim ** -0.5,
            sliding_window=cfg.sliding_window,
        )
        x = _out_and_mlp(lp, cfg, x, attn.reshape(batch * length, *attn.shape[2:]))
    return _logits(params, cfg, x).reshape(batch, length, -1)


def init_kv_caches(cfg: LlamaConfig, num_blocks: int, block_size: int, attention_backend: str = "reference",
                   dtype=None) -> list[jax.Array]:
    impl = layers.attention_backend(attention_backend)
    shape = impl.kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [jnp.zeros(shape, dtype or cfg.jnp_dtype) for _ in range(cfg.num_layers)]
