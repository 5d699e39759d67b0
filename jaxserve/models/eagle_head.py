"""An EAGLE head (EAGLE-1 format): its checkpoint, its forward, and its device programs of a step
(runner/eagle_runner.py calls them, ahead-of-time compiled).

The head is one Llama decoder layer over the target's features. At position p it reads the target's
final-normed hidden state f_p and the embedding of the token at p + 1, and gives a hidden state whose
target lm_head logits guess the token at p + 2:

    x = fc(concat(embed(token_{p+1}), f_p))      fc [2D, D] (+ bias)
    x = layer(x) at position p                   attention (no norm before it) + MLP, residual kept
    logits = target lm_head(x)                   (no final norm: the head regresses the target's feature)

Checkpoint (HF layout, safetensors): config.json of a one-layer Llama (hidden_size = the target's),
`fc.weight` [D, 2D], optional `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, optional
`embed_tokens.weight` (else the target's embedding); names may carry a `model.` prefix.

The head's paged KV cache (one layer) is indexed by the target's block tables. Each step runs fill, or, when
it samples, fill_propose: fill then propose as one program.

    fill(head, target params, staged batch, target hidden [T, D], caches, next_tokens [T], num_accepted, rows)
        the head's K/V at every token of the ragged batch whose next token is known: in the batch (-1: token
        t + 1), or on the host (>= 0: a prefill chunk's last token, whose next prompt token comes in a later
        chunk); -2: no write (a sampling request's last token, whose next token is the one the step samples,
        and padding) -> (caches, the target feature at each sampling row's last accepted position [M, D])
    propose(head, target params, block tables, those features, caches, tokens, num_accepted, rows) (in fill_propose)
        step 0 at each sampling row's last accepted position (its K/V now written with the step's real next
        token), step j > 0 one position further, reading the head's own output of step j - 1 -> drafts
        [M, k] (greedy), as draft_model.fill_propose's decode steps.

NOTE: a prefix-cache hit's last block holds head K/V computed with the next token of the request that wrote
it, which another request sharing the block may not have: its guesses may be worse, never its outputs.

Dimension alphabet (models/layers.py): T tokens, D width, V vocabulary, M rows, k draft tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxserve.models import llama, llama_hf, loader, registry
from jaxserve.models.layers import ModelBatch
from jaxserve.spec_decode.draft_model import decode_batch, first_rows, stack_drafts

LAYER_TENSORS = {  # HF name in layer 0 -> (our leaf, transposed)
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True), "post_attention_layernorm.weight": ("mlp_norm", False),
}


def fits_target(target) -> bool:
    """Whether a target model's config can carry an EAGLE-1 head (its embedding and lm head are read)."""
    return isinstance(target, llama.LlamaConfig)


def head_config(head_dir: str | Path, dtype: str) -> llama.LlamaConfig:
    """The head's layer as a one-layer LlamaConfig (config.json read as a Llama's, whatever its
    architectures say)."""
    return read_head_config(head_dir, dtype, "EAGLE-1")[1]


def read_head_config(head_dir: str | Path, dtype: str, kind: str) -> tuple[dict, llama.LlamaConfig]:
    """(config.json, its one plain Llama decoder layer as a LlamaConfig) of an EAGLE head of `kind`
    (EAGLE-1, EAGLE-3: named in the errors); CheckpointError for anything else."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise loader.CheckpointError(f"{head_dir} has no config.json; an {kind} head's directory needs one")
    hf = loader.read_json(path)
    cfg = llama_hf.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]}, dtype=dtype, source=str(path))
    if cfg.num_layers != 1:
        raise loader.CheckpointError(f"{path}: an {kind} head has one decoder layer, this config has "
                                     f"num_hidden_layers={cfg.num_layers}")
    extras = [name for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sliding_window") if getattr(cfg, name)]
    if extras:
        raise loader.CheckpointError(f"{path}: an {kind} head's layer is a plain Llama layer; this config asks for "
                                     f"{extras} (attention_bias, mlp_bias, ...), which jaxserve's {kind} does not run")
    return hf, cfg


def load_head(head_dir: str | Path, cfg: llama.LlamaConfig, place) -> dict:
    """The head's params {"fc", "fc_bias"?, "embed"?, "layer": {...}} from its safetensors, each leaf
    `place`d."""
    files = loader.weight_files(Path(head_dir))
    prefix = "model." if any(name.startswith("model.layers.0.") for name in files) else ""
    shapes = llama.abstract(cfg)["layers"][0]
    d, np_dtype = cfg.hidden_size, loader.NP_DTYPES[cfg.dtype]
    table = {f"{prefix}layers.0.{name}": (("layer", leaf), shapes[leaf].shape, transposed)
             for name, (leaf, transposed) in LAYER_TENSORS.items()}
    table[f"{prefix}fc.weight"] = (("fc",), (2 * d, d), True)
    for name, path, shape in ((f"{prefix}fc.bias", ("fc_bias",), (d,)),
                              (f"{prefix}embed_tokens.weight", ("embed",), (cfg.vocab_size, d))):
        if name in files:
            table[name] = (path, shape, False)
    missing, extra = sorted(set(table) - set(files)), sorted(set(files) - set(table))
    if missing or extra:  # (an input norm, a final norm or an lm head would be another head than EAGLE-1's)
        raise loader.CheckpointError(f"{head_dir}: not an EAGLE-1 head: " + "; ".join(
            [f"missing tensors {missing}"] * bool(missing) + [f"unexpected tensors {extra}"] * bool(extra)))
    params: dict = {"layer": {}}
    for name, (path, shape, transposed) in table.items():
        with safe_open(files[name], framework="numpy") as f:
            array = f.get_tensor(name)
        array = np.swapaxes(array, -1, -2) if transposed else array
        if array.size != int(np.prod(shape)):
            raise loader.CheckpointError(f"{head_dir}: tensor {name} has shape {list(array.shape)}, which does not "
                                         f"fit {list(shape)} from its config.json")
        leaf = place(np.ascontiguousarray(array.reshape(shape).astype(np_dtype)))
        (params["layer"] if path[0] == "layer" else params)[path[-1]] = leaf
    return params


def save_head(params: dict, cfg: llama.LlamaConfig, out: Path, **extra) -> None:
    """Writes the head in the layout load_head reads (no prefix; the fc bias and embedding if present)."""
    from safetensors.numpy import save_file

    tensors = {"fc.weight": np.ascontiguousarray(np.asarray(params["fc"]).T)}
    if "fc_bias" in params:
        tensors["fc.bias"] = np.asarray(params["fc_bias"])
    if "embed" in params:
        tensors["embed_tokens.weight"] = np.asarray(params["embed"])
    hf_shapes = {name: entry.shape for name, entry in llama_hf.hf_tensor_table(cfg).items()}
    for name, (leaf, transposed) in LAYER_TENSORS.items():
        shape, array = hf_shapes[f"model.layers.0.{name}"], np.asarray(params["layer"][leaf])
        if transposed:  # ours is HF's [out, in] transposed, heads split out
            array = np.swapaxes(array.reshape(*shape[:-2], shape[-1], shape[-2]), -1, -2)
        tensors[f"layers.0.{name}"] = np.ascontiguousarray(array.reshape(shape))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(llama_hf.to_hf_config(cfg, **extra), indent=2) + "\n")


def init_head(cfg: llama.LlamaConfig, key: jax.Array, fc_bias: bool = False, std: float = 0.02) -> dict:
    """Random head params (training): the layer as llama.init_params makes it, fc normal, no embedding."""
    layer = llama.init_params(cfg, key, std)["layers"][0]
    del layer["attn_norm"]
    d = cfg.hidden_size
    params = {"layer": layer, "fc": (std * jax.random.normal(jax.random.fold_in(key, 1), (2 * d, d))).astype(
        cfg.jnp_dtype)}
    if fc_bias:
        params["fc_bias"] = jnp.zeros(d, cfg.jnp_dtype)
    return params


def embed(params: dict, target_params: dict, tokens: jax.Array) -> jax.Array:
    """The head's embedding of `tokens` (its own, or the target's)."""
    return (params["embed"] if "embed" in params else target_params["embed"])[tokens]


def _fc(params: dict, embeds: jax.Array, features: jax.Array) -> jax.Array:
    x = jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1) @ params["fc"]
    return x + params["fc_bias"] if "fc_bias" in params else x


def forward(params: dict, cfg: llama.LlamaConfig, embeds: jax.Array, features: jax.Array, batch: ModelBatch,
            kv_cache: jax.Array, attention_backend: str, decode_only: bool = False) -> tuple[jax.Array, jax.Array]:
    """embeds, features [T, D] -> (the head's hidden states [T, D], kv_cache) over a ragged batch."""
    x = _fc(params, embeds, features)
    ones = jnp.ones(cfg.hidden_size, x.dtype)  # (the layer's "next norm": the residual stream is the output)
    _, x, kv_cache, _ = llama._layer(params["layer"], x, x, ones, kv_cache, batch, None, cfg=cfg,
                                     attention_backend=attention_backend, tp=None, decode_only=decode_only)
    return x, kv_cache


def forward_dense(params: dict, cfg: llama.LlamaConfig, embeds: jax.Array, features: jax.Array) -> jax.Array:
    """Cache-free causal forward for training: embeds, features [B, L, D] -> hidden states [B, L, D]."""
    batch, length, d = embeds.shape
    x = _fc(params, embeds, features).reshape(batch * length, d)
    lp = params["layer"]
    inv_freq = llama.layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q, k, v = llama._qkv(lp, cfg, x, jnp.tile(jnp.arange(length, dtype=jnp.int32), batch), inv_freq)
    attn = llama.layers.causal_attention(*(a.reshape(batch, length, *a.shape[1:]) for a in (q, k, v)),
                                         sm_scale=cfg.head_dim ** -0.5)
    _, x = llama._out_and_mlp(lp, cfg, x, attn.reshape(batch * length, *attn.shape[2:]),
                              jnp.ones(d, x.dtype))
    return x.reshape(batch, length, d)


def _replicated(tp, fn, num_args: int):
    """fn run whole on every device of tp's mesh (its inputs and outputs replicated), or as it is without
    tp: the head is small, and the Pallas attention kernels run only inside a shard_map."""
    if tp is None or tp.mesh.size == 1:
        return fn
    return tp.shard_map(fn, in_axes=((),) * num_args, out_axes=())


def _fill(params, target_params, batch: ModelBatch, hidden, kv_caches, next_tokens, num_accepted, rows, *, cfg,
          attention_backend, tp):
    """The head's K/V of every token of the step whose next token is known (module docstring) -> (caches,
    the target feature at each sampling row's last accepted position [M, D], propose's first input)."""
    shifted = jnp.concatenate([batch.token_ids[1:], batch.token_ids[:1]])
    tokens = jnp.where(next_tokens >= 0, next_tokens, shifted)
    batch = batch._replace(token_ids=tokens, slot_mapping=jnp.where(next_tokens == -2, 0, batch.slot_mapping))
    embeds = embed(params, target_params, tokens)
    step = _replicated(tp, lambda p, e, h, b, c: forward(p, cfg, e, h, b, c, attention_backend)[1], 5)
    return [step(params, embeds, hidden, batch, kv_caches[0])], hidden[rows[3] + num_accepted]


fill = jax.jit(_fill, static_argnames=("cfg", "attention_backend", "tp"), donate_argnames=("kv_caches",))


def _propose(params, target_params, batch_tables, features, kv_caches, tokens, num_accepted, rows, *, cfg,
             target_cfg, k: int, block_size: int, attention_backend: str, tp):
    """features [M, D] (fill's), rows [4, M] (runner/draft_runner.DraftRunner.rows) -> (caches, drafts [M, k]),
    as draft_model.fill_propose's decode steps."""
    num_rows = tokens.shape[0]
    features, tokens, num_accepted, rows = first_rows(batch_tables.shape[0], features, tokens, num_accepted, rows)
    batch_row, base, capacity = rows[0], rows[1], rows[2]
    block_tables = batch_tables[batch_row]
    positions = base - 1 + num_accepted  # each row's last accepted position
    kv_cache = kv_caches[0]
    step = _replicated(tp, lambda p, e, h, b, c: forward(p, cfg, e, h, b, c, attention_backend, decode_only=True), 5)
    head_logits = registry.family_of(target_cfg).head_logits
    drafts = []
    for _ in range(k):
        batch = decode_batch(tokens, positions, capacity, block_tables, block_size)
        features, kv_cache = step(params, embed(params, target_params, tokens), features, batch, kv_cache)
        tokens = jnp.argmax(head_logits(target_params, target_cfg, features), axis=-1).astype(jnp.int32)
        drafts.append(tokens)
        positions = positions + 1
    return [kv_cache], stack_drafts(drafts, num_rows)


def _fill_propose(params, target_params, batch: ModelBatch, hidden, kv_caches, next_tokens, num_accepted, rows,
                  tokens, *, cfg, target_cfg, k: int, block_size: int, attention_backend: str, tp):
    """fill, then propose from its features, as one program (a step that samples): fill's arguments and
    propose's `tokens` -> propose's outputs."""
    kv_caches, features = _fill(params, target_params, batch, hidden, kv_caches, next_tokens, num_accepted, rows,
                                cfg=cfg, attention_backend=attention_backend, tp=tp)
    return _propose(params, target_params, batch.block_tables, features, kv_caches, tokens, num_accepted, rows,
                    cfg=cfg, target_cfg=target_cfg, k=k, block_size=block_size, attention_backend=attention_backend,
                    tp=tp)


fill_propose = jax.jit(_fill_propose, static_argnames=("cfg", "target_cfg", "k", "block_size", "attention_backend",
                                                       "tp"), donate_argnames=("kv_caches",))
