"""Llama-family decoder: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), with GQA and tied or untied embeddings — one module, config switches.
With `cfg.moe` the layers it names use the mixture-of-experts MLP of moe.py instead of the dense
one (Mixtral, Qwen2-MoE, Qwen3-MoE; their HF side is moe_hf.py): a layer whose params hold a
"router" is an MoE layer.

Params are a pytree of nested dicts; weights are stored in `x @ W` orientation with heads split
out (wq [D, N, H], wo [N, H, D]) so every matmul is an einsum in the dimension alphabet of
layers.py. `AXES` names every tensor's axes logically once; `abstract(cfg)` derives the shapes from
them, and sharding/rules.py maps them onto the mesh.

    forward(params, cfg, batch, kv_caches, tp=None) -> (logits [num_logits, V] float32, kv_caches)

Tensor parallel over tp > 1 devices (`tp`; params from `param_placer`, caches from `init_kv_caches`):
the whole step runs in one shard_map, each device on its N/tp query heads, its kv heads, F/tp MLP
columns and V/tp vocabulary rows:

    ids --embedding: local lookup + psum--> x [T, D] (replicated)
    per layer: norm -> q/k/v (column-parallel) -> paged attention on local heads and local cache
               -> o (row-parallel) -> psum -> + residual -> norm -> gate/up (column) -> down (row)
               -> psum -> + residual -> the next layer's norm  (two all-reduces of [T, D] per layer;
                  with the GPU kernel, each psum + add + norm is one kernel: _add_norm)
    logits: local [num_logits, V/tp] --all_gather--> [num_logits, V] (padded vocab cut off)

Expert parallel (`tp.expert`, mesh [expert, model]): the same shard_map over both axes; every batch field
and cache carries a leading expert-shard axis, so each expert shard runs the above on its own requests,
and MoE layers exchange routed tokens over "expert" (moe.moe_mlp's `routed`; docs/ARCHITECTURE.md §7.5).

Layers are unrolled in Python with one cache array per layer (a list), donated by the caller's
jit: XLA compiles this into a far faster decode step than `lax.scan` over stacked layers with the
caches as scanned carries (docs/ARCHITECTURE.md §2.3). Each layer is a call of one jitted `_layer`,
traced once per step shape and inlined by XLA, so lowering a step traces one layer instead of all of
them (lowering and warm-start times: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.models import layers, moe, quant
from jaxserve.models.layers import ModelBatch
from sharding import TensorParallel, all_gather, all_reduce_kernel, psum, sharded_lookup
from sharding.expert_parallel import ep_moe

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
    moe: moe.MoeSpec | None = None  # mixture-of-experts MLP in the layers it names
    quantization: quant.QuantSpec | None = None  # FP8 dense weights (QUANTIZED); None: all in `dtype`

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
        if self.moe is not None and not set(self.moe.sparse_layers) <= set(range(self.num_layers)):
            raise ValueError(f"MoE layers {list(self.moe.sparse_layers)} are not all among the "
                             f"{self.num_layers} layers")
        if self.moe is not None and self.mlp_bias:
            raise ValueError("mlp_bias is not supported with a mixture-of-experts MLP")
        if self.moe is not None and self.quantization is not None:
            raise ValueError("FP8 weights (quantization) are not supported for mixture-of-experts models yet; "
                             "load a bfloat16 or float16 checkpoint without quantization")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]


# The logical axes of every parameter, by name: D "embed", N "heads", K "kv_heads", H "head_dim",
# F "mlp", V "vocab".
AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "final_norm": ("embed",),
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed"),
    "bq": ("heads", "head_dim"), "bk": ("kv_heads", "head_dim"), "bv": ("kv_heads", "head_dim"), "bo": ("embed",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
    "b_gate": ("mlp",), "b_up": ("mlp",), "b_down": ("embed",),
    **moe.AXES,
    # An fp8 KV cache's static K and V scales per kv head (float32), added by models/kv_scales.py
    "kv_scale": (None, "kv_heads"),
}
# The weights FP8 quantization applies to (every dense matmul of the decoder; embeddings, lm_head, norms,
# biases and the MoE router stay in the model dtype), each with its number of leading input axes.
QUANTIZED: dict[str, int] = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
COMM_AXES = ("tp_shard", None)  # the all-reduce kernel's state: one row per tensor-parallel device


def abstract(cfg: LlamaConfig) -> Params:
    """Shape and dtype of every parameter, as jax.ShapeDtypeStruct leaves (shapes from `AXES`)."""
    sizes = {"embed": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size, "vocab": cfg.vocab_size}

    def leaf(name):
        shape = tuple(sizes[a] for a in AXES[name])
        if cfg.quantization is not None and name in QUANTIZED:
            return quant.abstract(cfg.quantization, shape, AXES[name], QUANTIZED[name])
        return jax.ShapeDtypeStruct(shape, cfg.jnp_dtype)

    def s(*names):
        return {name: leaf(name) for name in names}

    layer = s("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
    if cfg.qkv_bias:
        layer |= s("bq", "bk", "bv")
    if cfg.o_bias:
        layer |= s("bo")
    if cfg.mlp_bias:
        layer |= s("b_gate", "b_up", "b_down")
    if cfg.qk_norm:
        layer |= s("q_norm", "k_norm")
    layer_params = [dict(layer) for _ in range(cfg.num_layers)]
    for i in cfg.moe.sparse_layers if cfg.moe is not None else ():
        for name in ("w_gate", "w_up", "w_down"):
            del layer_params[i][name]
        layer_params[i] |= moe.abstract(cfg.moe, cfg.hidden_size, cfg.jnp_dtype)
    params: Params = s("embed", "final_norm") | {"layers": layer_params}
    if not cfg.tie_word_embeddings:
        params |= s("lm_head")
    return params


def _is_weight(node) -> bool:
    return isinstance(node, quant.Fp8Weight)


def param_axes(params: Params) -> Params:
    """The logical axes of each leaf of a params pytree (a pytree of tuples; an Fp8Weight's scale is
    sharded along q's full axes: quant.scale_axes)."""
    def axes(path, leaf):
        names = AXES[path[-1].key]
        return quant.Fp8Weight(names, quant.scale_axes(names, leaf.block), leaf.block) if _is_weight(leaf) else names
    return jax.tree_util.tree_map_with_path(axes, params, is_leaf=_is_weight)


def param_placer(tp: TensorParallel) -> Callable[[tuple, Any], Any]:
    """`place(path, array)` for the loader: each tensor straight into its sharding (padded or replicated
    first where the rules say so), one device slice at a time; an Fp8Weight's q and scale alike."""
    def place(path, array):
        name, axes = "/".join(map(str, path)), AXES[path[-1]]
        if _is_weight(array):
            return quant.Fp8Weight(tp.place(array.q, axes, name),
                                   tp.place(array.scale, quant.scale_axes(axes, array.block), name), array.block)
        return tp.place(array, axes, name)
    return place


def param_init(name: str) -> str:
    """How the parameter named `name` starts when made at random: norms "ones", biases "zeros", weights
    "normal" (used by init_params and by the loader's dummy weights)."""
    if name.endswith("norm"):
        return "ones"
    return "zeros" if name.startswith("b") else "normal"


def init_params(cfg: LlamaConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random parameters (training from scratch and tests), as `param_init` says; with
    `cfg.quantization`, the same weights quantized per output channel (quantize_params)."""
    if cfg.quantization is not None:
        return quantize_params(init_params(dataclasses.replace(cfg, quantization=None), key, std))
    leaves, treedef = jax.tree.flatten_with_path(abstract(cfg))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), leaf_key in zip(leaves, keys):
        init = param_init(str(path[-1].key))
        if init == "ones":
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        elif init == "zeros":
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            out.append((std * jax.random.normal(leaf_key, leaf.shape, jnp.float32)).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, out)


def quantize_params(params: Params) -> Params:
    """Float params -> the same with every QUANTIZED weight an Fp8Weight (per-output-channel scales)."""
    layers_out = [{name: quant.quantize(w, QUANTIZED[name]) if name in QUANTIZED else w for name, w in lp.items()}
                  for lp in params["layers"]]
    return {**params, "layers": layers_out}


def _qkv(lp: Params, cfg: LlamaConfig, x: jax.Array, positions: jax.Array, inv_freq):
    """x [T, D] -> q [T, N, H], k, v [T, K, H] with bias, q/k norm and rope applied."""
    if "wqkv" in lp:  # (FP8 weights joined on one GPU: runner/device_setup.FUSED_FP8)
        heads, kv_heads = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = jnp.split(quant.linear(x, lp["wqkv"]), (heads, heads + kv_heads), axis=-1)
        q, k, v = (a.reshape(x.shape[0], -1, cfg.head_dim) for a in (q, k, v))
    else:
        q = quant.linear(x, lp["wq"], "td,dnh->tnh")
        k = quant.linear(x, lp["wk"], "td,dkh->tkh")
        v = quant.linear(x, lp["wv"], "td,dkh->tkh")
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if cfg.qk_norm:
        q = layers.rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = layers.rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq), v


def _add_norm(x: jax.Array, partial: jax.Array, bias: jax.Array | None, weight: jax.Array, cfg: LlamaConfig,
              tp: TensorParallel | None = None, logical: str = "", comm: jax.Array | None = None):
    """x' = x + all-reduce(partial) (+ bias), then (rms_norm(x') * weight, x'): the residual update that
    closes a block and the norm that opens the next. One kernel where tp's all-reduce fuses them
    (decode-sized, no bias); otherwise sharding.psum, the add and layers.rms_norm."""
    kernel = all_reduce_kernel(tp, logical, comm)
    if bias is None and kernel is not None and getattr(kernel, "fits_rms_norm", lambda _: False)(partial):
        return kernel.add_rms_norm(partial, x, weight, cfg.rms_norm_eps, comm)
    o = psum(partial, tp, logical, comm)
    if bias is not None:
        o = o + bias
    x = x + o
    return layers.rms_norm(x, weight, cfg.rms_norm_eps), x


def _out_and_mlp(lp: Params, cfg: LlamaConfig, x: jax.Array, attn: jax.Array, next_norm: jax.Array,
                 tp: TensorParallel | None = None, comm: jax.Array | None = None,
                 routed: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention output projection + residual, then the MLP block + residual. x [T, D] (the residual
    stream). Returns (rms_norm(x) * next_norm, the next block's input; x).

    With `tp` (inside shard_map) attn holds the local heads: wo is row-parallel, so one all-reduce
    completes the attention block (biases are added once, after it); the MLP does the same. `comm`:
    the all-reduce kernel's state (sharding.psum), None for XLA's. `routed`: an MoE layer's expert-parallel
    dispatch (moe.moe_mlp)."""
    # NOTE: a 2-D matmul over the flattened (N, H) axis; einsum "tnh,nhd->td" made XLA relayout
    # (copy) the whole wo weight every step.
    wo = quant.merge_leading(lp["wo"], 2)
    o = quant.linear(attn.reshape(-1, wo.shape[0]), wo)
    h, x = _add_norm(x, o, lp["bo"] if cfg.o_bias else None, lp["mlp_norm"], cfg, tp, "heads", comm)
    if "router" in lp:
        down = moe.moe_mlp(lp, h, cfg.moe, routed)
    else:
        gate_up_biases = (lp["b_gate"], lp["b_up"]) if cfg.mlp_bias else None
        gate_up = (lp["w_gate_up"],) if "w_gate_up" in lp else (lp["w_gate"], lp["w_up"])
        down = layers.gated_mlp(h, *gate_up, lp["w_down"], gate_up_biases=gate_up_biases)
    return _add_norm(x, down, lp["b_down"] if cfg.mlp_bias else None, next_norm, cfg, tp, "mlp", comm)


def _next_norms(params: Params) -> list[jax.Array]:
    """The norm that follows each layer: the next layer's attention norm, the final norm after the last."""
    return [lp["attn_norm"] for lp in params["layers"][1:]] + [params["final_norm"]]


def _head(params: Params, cfg: LlamaConfig, h: jax.Array, tp: TensorParallel | None = None,
          comm: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states -> float32 logits (gathered over the vocabulary shards)."""
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("...d,vd->...v", h, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...d,dv->...v", h, params["lm_head"], preferred_element_type=jnp.float32)
    return all_gather(logits, tp, "vocab", axis=-1, comm=comm)


def _expert_parallel(tp: TensorParallel, placement, moe_layer: jax.Array, valid: jax.Array,
                     loads: list) -> Callable:
    """An MoE layer's `routed` under expert parallelism: this shard's tokens (`valid`: not padding) to their
    experts' slots by `placement` row `moe_layer`, and back (sharding/expert_parallel.ep_moe). The call's
    per-expert token count [E] is appended to `loads` (routed runs inside the caller's trace, so the
    caller returns it as an output of the same program)."""
    def routed(x, weights, ids, lp):
        result = ep_moe(x, ids, weights, (lp["we_gate_up"], lp["we_down"]), placement, moe_layer,
                        expert_fn=moe.slot_ffn, axis=tp.expert.axis, valid=valid, path=tp.expert.path,
                        platform=tp.mesh.devices.flat[0].platform)
        loads.append(result.load)
        return result.out
    return routed


@functools.partial(jax.jit, static_argnames=("cfg", "attention_backend", "tp", "decode_only",
                                             "flash_prefill_threshold"))
def _layer(lp: Params, h: jax.Array, x: jax.Array, next_norm: jax.Array, kv_cache: jax.Array, batch: ModelBatch,
           comm: jax.Array | None, placement=None, moe_layer: jax.Array | None = None, *, cfg: LlamaConfig,
           attention_backend: str, tp: TensorParallel | None, decode_only: bool,
           flash_prefill_threshold: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One decoder layer: (h = rms_norm(x) * attn_norm, x) -> (the next block's h, x, kv_cache). Jitted
    on its own so the step traces it once per shape, not once per layer (XLA inlines the calls: the
    compiled step is the same; warm starts lower each step shape faster). `placement`, `moe_layer`: the
    expert placement tables and this layer's row in them (expert parallelism; the row is traced, so every
    MoE layer shares one trace). The fourth output: an expert-parallel MoE layer's tokens per logical expert
    [E] int32 (this shard's, padding excluded), else None. `flash_prefill_threshold`: layers.paged_attention's."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q, k, v = _qkv(lp, cfg, h, batch.positions, inv_freq)
    attn, kv_cache = layers.paged_attention(
        q, k, v, kv_cache, batch, sm_scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
        backend=attention_backend, decode_only=decode_only, kv_scale=lp.get("kv_scale"),
        flash_prefill_threshold=flash_prefill_threshold,
    )
    routed, loads = None, []
    if placement is not None and "router" in lp:
        valid = jnp.arange(h.shape[0]) < batch.query_start_loc[-1]  # the batch's tokens; the rest is padding
        routed = _expert_parallel(tp, placement, moe_layer, valid, loads)
    h, x = _out_and_mlp(lp, cfg, x, attn, next_norm, tp, comm, routed)
    return h, x, kv_cache, (loads[0] if loads else None)


def head_logits(params: Params, cfg: LlamaConfig, h: jax.Array) -> jax.Array:
    """Final-normed hidden states [..., D] -> float32 logits [..., V], outside any shard_map (under
    tensor parallelism XLA partitions the matmul over the vocabulary-sharded weights itself)."""
    return _head(params, cfg, h)[..., : cfg.vocab_size]


def _step(params: Params, batch: ModelBatch, kv_caches: list[jax.Array], comm: jax.Array | None = None,
          placement=None, *, cfg: LlamaConfig, attention_backend: str, tp: TensorParallel | None,
          decode_only: bool = False, return_hidden: bool = False, aux_layers: tuple[int, ...] = (),
          flash_prefill_threshold: int = 0) -> tuple:
    """The step on one device's params and caches: all of them, or (with `tp`) its shards. With `placement`
    the last output is the step's expert load [L, E] int32: tokens per logical expert of each MoE layer,
    summed over the expert shards (replicated). `aux_layers`: forward's."""
    x = sharded_lookup(params["embed"], batch.token_ids, tp, "vocab", comm)  # [T, D]
    h = layers.rms_norm(x, params["layers"][0]["attn_norm"], cfg.rms_norm_eps)
    new_caches, loads, aux = [], [], []
    moe_rows = {layer: row for row, layer in enumerate(cfg.moe.sparse_layers)} if cfg.moe is not None else {}
    for i, (lp, next_norm, kv_cache) in enumerate(zip(params["layers"], _next_norms(params), kv_caches)):
        moe_layer = jnp.int32(moe_rows[i]) if placement is not None and i in moe_rows else None
        if i in aux_layers:
            aux.append(x)
        h, x, kv_cache, load = _layer(lp, h, x, next_norm, kv_cache, batch, comm, placement, moe_layer, cfg=cfg,
                                      attention_backend=attention_backend, tp=tp, decode_only=decode_only,
                                      flash_prefill_threshold=flash_prefill_threshold)
        new_caches.append(kv_cache)
        if load is not None:
            loads.append(load)
    logits = _head(params, cfg, h[batch.logits_indices], tp, comm)
    out = (logits, new_caches, h) if return_hidden else (logits, new_caches)
    if aux_layers:
        out = (*out, jnp.concatenate(aux, axis=-1))
    if placement is None:
        return out
    load = jnp.stack(loads) if loads else jnp.zeros((0, cfg.moe.num_experts), jnp.int32)
    return (*out, jax.lax.psum(load, tp.expert.axis))


def _expert_shard_step(params, batch, kv_caches, comm, placement, **kwargs):
    """_step on one expert shard's slice of the [expert_shard, ...] batch and caches (one row each)."""
    batch = jax.tree.map(lambda a: a[0], batch)
    logits, kv_caches, *rest = _step(params, batch, [c[0] for c in kv_caches], comm, placement, **kwargs)
    return (logits, [c[None] for c in kv_caches], *rest)


def forward(
    params: Params,
    cfg: LlamaConfig,
    batch: ModelBatch,
    kv_caches: list[jax.Array],
    attention_backend: str = "reference",
    tp: TensorParallel | None = None,
    decode_only: bool = False,
    comm: jax.Array | None = None,
    return_hidden: bool = False,
    placement=None,
    aux_layers: tuple[int, ...] = (),
    flash_prefill_threshold: int = 0,
) -> tuple:
    """One engine step over the ragged batch. Returns float32 logits for `batch.logits_indices` and the
    caches; with `return_hidden`, also every token's final-normed hidden state [T, D] (for `head_logits`).

    `tp` with more than one shard runs the step tensor-parallel over its mesh (module docstring);
    without it, or with one shard, the step is the plain single-device one. `decode_only`: see
    layers.paged_attention (one query token per request, in request order). `comm`: the state of
    `tp.all_reduce` (one row per device, sharded over "model"); None runs XLA's all-reduces.

    Expert parallelism (`tp.expert`; `placement`: the expert placement tables, core/eplb.Placement of
    device arrays): every batch field and cache has a leading expert-shard axis [n, ...] split over the
    "expert" mesh axis, each shard attending over its own requests and cache; the logits come back
    shard-major, [n * num_logits, V]; MoE layers exchange routed tokens over the expert axis, and the last
    output is the step's expert load [L, E] int32 (tokens per logical expert of each MoE layer, padding
    excluded; rows in cfg.moe.sparse_layers order, the placement tables' rows).

    `aux_layers` (sorted layer indices; an EAGLE-3 head reads them): one more output after the hidden
    states, the residual stream entering each of those layers, concatenated [T, len(aux_layers) * D].

    `flash_prefill_threshold` (runner.flash_prefill_token_threshold; 0: off): a request with at least that
    many of the step's tokens prefills through the flash attention (layers.paged_attention)."""
    if tp is None or tp.mesh.size == 1:
        return _step(params, batch, kv_caches, cfg=cfg, attention_backend=attention_backend, tp=None,
                     decode_only=decode_only, return_hidden=return_hidden, aux_layers=aux_layers,
                     flash_prefill_threshold=flash_prefill_threshold)
    shard = ("expert_shard",) if tp.expert is not None else ()
    cache_axes = [(*shard, *layers.kv_cache_axes(attention_backend))] * len(kv_caches)
    comm_axes = COMM_AXES if comm is not None else ()
    step = _expert_shard_step if shard else _step
    out_axes = (shard, cache_axes, shard) if return_hidden else (shard, cache_axes)
    if aux_layers:
        out_axes = (*out_axes, shard)
    if placement is not None:
        out_axes = (*out_axes, ())  # the expert load, summed over the shards
    sharded_step = tp.shard_map(functools.partial(step, cfg=cfg, attention_backend=attention_backend, tp=tp,
                                                  decode_only=decode_only, return_hidden=return_hidden,
                                                  aux_layers=aux_layers,
                                                  flash_prefill_threshold=flash_prefill_threshold),
                                in_axes=(param_axes(params), shard, cache_axes, comm_axes, ()), out_axes=out_axes)
    logits, kv_caches, *rest = sharded_step(params, batch, kv_caches, comm, placement)
    if logits.shape[-1] != cfg.vocab_size:  # the vocabulary was padded to a multiple of tp
        logits = logits[:, : cfg.vocab_size]
    return (logits, kv_caches, *rest)


def forward_dense(params: Params, cfg: LlamaConfig, token_ids: jax.Array, return_hidden: bool = False):
    """Cache-free causal forward for training and tests: token_ids [B, T] -> logits [B, T, V]; with
    `return_hidden`, (logits, final-normed hidden states [B, T, D]) (an EAGLE head's training features)."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    batch, length = token_ids.shape
    positions = jnp.arange(length, dtype=jnp.int32)
    x = params["embed"][token_ids.reshape(-1)]  # [B*T, D]
    h = layers.rms_norm(x, params["layers"][0]["attn_norm"], cfg.rms_norm_eps)
    for lp, next_norm in zip(params["layers"], _next_norms(params)):
        q, k, v = _qkv(lp, cfg, h, jnp.tile(positions, batch), inv_freq)
        attn = layers.causal_attention(
            q.reshape(batch, length, *q.shape[1:]), k.reshape(batch, length, *k.shape[1:]),
            v.reshape(batch, length, *v.shape[1:]), sm_scale=cfg.head_dim ** -0.5,
            sliding_window=cfg.sliding_window,
        )
        h, x = _out_and_mlp(lp, cfg, x, attn.reshape(batch * length, *attn.shape[2:]), next_norm)
    logits = _head(params, cfg, h).reshape(batch, length, -1)
    return (logits, h.reshape(batch, length, -1)) if return_hidden else logits


def init_kv_caches(cfg: LlamaConfig, num_blocks: int, block_size: int, attention_backend: str = "reference",
                   dtype=None, tp: TensorParallel | None = None) -> list[jax.Array]:
    """One cache array per layer, in the backend's layout. With `tp`: sharded by kv heads, each made in
    place on its devices; kv heads are replicated up to tp when num_kv_heads < tp (sharding/rules.py).
    With expert parallelism each expert shard has a cache of its own: [n, *layout] split over "expert"."""
    impl = layers.attention_backend(attention_backend)
    dtype = dtype or cfg.jnp_dtype
    if tp is None:
        shape = impl.kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]
    num_kv_heads = tp.global_size("kv_heads", cfg.num_kv_heads, "num_key_value_heads")
    shape = impl.kv_cache_shape(num_blocks, block_size, num_kv_heads, cfg.head_dim)
    axes = layers.kv_cache_axes(attention_backend)
    if tp.expert is not None:
        shape, axes = (tp.expert_size, *shape), ("expert_shard", *axes)
    return [tp.zeros(shape, dtype, axes) for _ in range(cfg.num_layers)]
