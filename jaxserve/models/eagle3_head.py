"""An EAGLE-3 head: its checkpoint, its forward, and its device programs of a step
(runner/eagle_runner.Eagle3Runner calls them, ahead-of-time compiled).

The head reads the target's residual stream entering a few of its layers (the aux layers, default
(2, L // 2, L - 3)), not its final feature. At position p, with a_p the concatenated aux states
[n * D] and e the embedding of the token at p + 1:

    g = fc(a_p)                                          fc [n * D, D], no bias
    y = attn(concat(input_layernorm(e), hidden_norm(g)))   q/k/v read the 2D-wide concat
    r = g + y;  r = r + mlp(post_attention_layernorm(r))   r: the head's pre-norm output
    logits = lm_head(norm(r))                            over the draft vocabulary [V_draft]
    guess = d2t(argmax logits)                           target id = i + d2t[i]

(`norm_before_residual`: the residual is hidden_norm(g) instead of g.) Guessing further, position p + 1
reads r in place of g: fc maps only the target's states. The draft vocabulary is a subset of the
target's; `d2t` holds each draft id's offset to its target id (absent: the identity), `t2d` is not read.

Checkpoint (HF layout, safetensors; names may carry a `model.` prefix): config.json of a one-layer Llama
(hidden_size and vocab_size the target's; `draft_vocab_size`, optional `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`), `norm_before_residual`),
`midlayer.*` or `layers.0.*` (`self_attn.{q,k,v}_proj.weight` [.., 2D], `o_proj`, `mlp.*`,
`input_layernorm`, `hidden_norm`, `post_attention_layernorm`), `fc.weight` [D, n * D], `norm.weight`,
`lm_head.weight` [V_draft, D], optional `d2t` [V_draft], `t2d`, `embed_tokens.weight` (else the
target's embedding).

The step's programs are those of the EAGLE-1 head (models/eagle_head.py: what fill writes where, and
what propose reads), with fc applied to the aux states in fill, and the head's own lm head and d2t.

Dimension alphabet (models/layers.py): T tokens, D width, V vocabulary, M rows, k draft tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxserve.models import eagle_head, layers, llama, llama_hf, loader
from jaxserve.models.eagle_head import _replicated, embed
from jaxserve.models.layers import ModelBatch
from jaxserve.spec_decode.draft_model import decode_batch, first_rows, stack_drafts

LAYER_TENSORS = {  # HF name in the layer -> (our leaf, transposed)
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True), "input_layernorm.weight": ("attn_norm", False),
    "hidden_norm.weight": ("hidden_norm", False), "post_attention_layernorm.weight": ("mlp_norm", False),
}


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head as its programs see it (hashable: a static argument)."""

    layer: llama.LlamaConfig  # its decoder layer (q/k/v read 2 * hidden_size)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target layers whose entering residual stream fc reads (as given)
    norm_before_residual: bool = False


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def head_config(head_dir: str | Path, dtype: str, target_num_layers: int) -> Eagle3Config:
    """The head's config.json (read as a Llama's, whatever its architectures say); the aux layers default
    to (2, L // 2, L - 3) of the target's L layers."""
    hf, cfg = eagle_head.read_head_config(head_dir, dtype, "EAGLE-3")
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer=cfg, draft_vocab_size=int(hf.get("draft_vocab_size") or cfg.vocab_size),
                        target_hidden_size=int(hf.get("target_hidden_size") or cfg.hidden_size),
                        aux_layers=tuple(int(i) for i in aux) if aux else default_aux_layers(target_num_layers),
                        norm_before_residual=bool(hf.get("norm_before_residual", False)))


def shapes(head: Eagle3Config) -> dict:
    """Every leaf's shape: {"layer": {...}, "fc", "final_norm", "lm_head"} (d2t and embed aside)."""
    cfg, d = head.layer, head.layer.hidden_size
    qkv_in = {"wq": (2 * d, cfg.num_heads, cfg.head_dim), "wk": (2 * d, cfg.num_kv_heads, cfg.head_dim),
              "wv": (2 * d, cfg.num_kv_heads, cfg.head_dim)}
    layer = {name: leaf.shape for name, leaf in llama.abstract(cfg)["layers"][0].items()} | qkv_in
    return {"layer": layer | {"hidden_norm": (d,)}, "fc": (len(head.aux_layers) * head.target_hidden_size, d),
            "final_norm": (d,), "lm_head": (d, head.draft_vocab_size)}


def _hf_shape(leaf: str, shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    """A leaf's tensor shape in the checkpoint: HF's [out, in] for linear weights (wo's in: the heads)."""
    if not transposed:
        return tuple(shape)
    if leaf == "wo":
        return shape[-1], int(np.prod(shape[:-1]))
    return int(np.prod(shape[1:])), shape[0]


def load_head(head_dir: str | Path, head: Eagle3Config, place) -> dict:
    """The head's params {"layer": {...}, "fc", "final_norm", "lm_head", "d2t", "embed"?} from its
    safetensors, each leaf `place`d; d2t as target ids [V_draft] int32 (the identity when absent)."""
    files = loader.weight_files(Path(head_dir))
    names = {(name[len("model."):] if name.startswith("model.") else name): name for name in files}
    layer_prefix = "midlayer." if any(name.startswith("midlayer.") for name in names) else "layers.0."
    want = shapes(head)
    table = {f"{layer_prefix}{name}": (("layer", leaf), want["layer"][leaf], transposed)
             for name, (leaf, transposed) in LAYER_TENSORS.items()}
    table |= {"fc.weight": (("fc",), want["fc"], True), "norm.weight": (("final_norm",), want["final_norm"], False),
              "lm_head.weight": (("lm_head",), want["lm_head"], True)}
    if "embed_tokens.weight" in names:
        table["embed_tokens.weight"] = (("embed",), (head.layer.vocab_size, head.layer.hidden_size), False)
    optional = {"d2t", "t2d"}
    missing, extra = sorted(set(table) - set(names)), sorted(set(names) - set(table) - optional)
    if missing or extra:
        raise loader.CheckpointError(f"{head_dir}: not an EAGLE-3 head: " + "; ".join(
            [f"missing tensors {missing}"] * bool(missing) + [f"unexpected tensors {extra}"] * bool(extra)))
    np_dtype = loader.NP_DTYPES[head.layer.dtype]
    params: dict = {"layer": {}}
    for name, (path, shape, transposed) in table.items():
        with safe_open(files[names[name]], framework="numpy") as f:
            array = f.get_tensor(names[name])
        expected = _hf_shape(path[-1], shape, transposed)
        if array.shape != expected:
            raise loader.CheckpointError(f"{head_dir}: tensor {name} has shape {list(array.shape)}, but its "
                                         f"config.json (and the aux layers it reads) give {list(expected)}")
        array = np.swapaxes(array, -1, -2) if transposed else array
        leaf = place(np.ascontiguousarray(array.reshape(shape).astype(np_dtype)))
        (params["layer"] if path[0] == "layer" else params)[path[-1]] = leaf
    targets = np.arange(head.draft_vocab_size, dtype=np.int64)
    if "d2t" in names:
        with safe_open(files[names["d2t"]], framework="numpy") as f:
            d2t = f.get_tensor(names["d2t"])
        if d2t.shape != (head.draft_vocab_size,):
            raise loader.CheckpointError(f"{head_dir}: d2t has shape {list(d2t.shape)}, but draft_vocab_size is "
                                         f"{head.draft_vocab_size}: it needs one offset per draft token")
        targets = targets + d2t.astype(np.int64)
        if targets.min() < 0 or targets.max() >= head.layer.vocab_size:
            raise loader.CheckpointError(f"{head_dir}: d2t maps draft ids to target ids outside "
                                         f"[0, {head.layer.vocab_size}): its offsets are not this vocabulary's")
    params["d2t"] = place(targets.astype(np.int32))
    return params


def save_head(params: dict, head: Eagle3Config, out: Path, d2t: np.ndarray | None = None) -> None:
    """Writes the head in the common EAGLE-3 layout (`midlayer.*`, d2t offsets, t2d), config.json included."""
    from safetensors.numpy import save_file

    def hf(array, leaf: str, transposed: bool):  # ours (x @ W, heads split out) -> HF's [out, in]
        array = np.asarray(array, np.float32)
        if transposed:
            array = (array.reshape(-1, array.shape[-1]) if leaf == "wo" else array.reshape(array.shape[0], -1)).T
        return np.ascontiguousarray(array)

    tensors = {"fc.weight": hf(params["fc"], "fc", True), "norm.weight": hf(params["final_norm"], "norm", False),
               "lm_head.weight": hf(params["lm_head"], "lm_head", True)}
    for name, (leaf, transposed) in LAYER_TENSORS.items():
        tensors[f"midlayer.{name}"] = hf(params["layer"][leaf], leaf, transposed)
    vocab = head.layer.vocab_size
    if d2t is not None:
        tensors["d2t"] = np.asarray(d2t, np.int64)
        t2d = np.zeros(vocab, bool)
        t2d[np.arange(len(d2t)) + d2t] = True
        tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = llama_hf.to_hf_config(head.layer, draft_vocab_size=head.draft_vocab_size,
                                   eagle_aux_hidden_state_layer_ids=list(head.aux_layers),
                                   target_hidden_size=head.target_hidden_size)
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def init_head(head: Eagle3Config, key: jax.Array, std: float = 0.02) -> dict:
    """Random head params for training (no d2t: the trainer maps draft ids itself): weights normal, norms
    ones."""
    dtype, want = head.layer.jnp_dtype, shapes(head)

    def leaf(name: str, shape, i: int):
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        return (std * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)

    out = {name: leaf(name, shape, i) for i, (name, shape) in enumerate(want.items()) if name != "layer"}
    out["layer"] = {name: leaf(name, shape, 100 + i) for i, (name, shape) in enumerate(want["layer"].items())}
    return out


def features(params: dict, aux: jax.Array) -> jax.Array:
    """The target's aux states [..., n * D] -> the head's input hidden states [..., D] (fc)."""
    return aux.astype(params["fc"].dtype) @ params["fc"]


def _layer_inputs(params: dict, head: Eagle3Config, embeds: jax.Array, hidden: jax.Array):
    """-> (the attention's 2D-wide input, the residual stream)."""
    lp, eps = params["layer"], head.layer.rms_norm_eps
    normed = layers.rms_norm(hidden, lp["hidden_norm"], eps)
    residual = normed if head.norm_before_residual else hidden
    return jnp.concatenate([layers.rms_norm(embeds, lp["attn_norm"], eps), normed], axis=-1), residual


def logits(params: dict, normed: jax.Array) -> jax.Array:
    """The final-normed output [..., D] -> float32 logits over the draft vocabulary [..., V_draft]."""
    return jnp.einsum("...d,dv->...v", normed, params["lm_head"], preferred_element_type=jnp.float32)


def forward(params: dict, head: Eagle3Config, embeds: jax.Array, hidden: jax.Array, batch: ModelBatch,
            kv_cache: jax.Array, attention_backend: str, decode_only: bool = False):
    """embeds, hidden [T, D] -> (final-normed outputs, pre-norm outputs [T, D], kv_cache) over a ragged batch."""
    x, residual = _layer_inputs(params, head, embeds, hidden.astype(embeds.dtype))
    normed, out, kv_cache, _ = llama._layer(params["layer"], x, residual, params["final_norm"], kv_cache, batch, None,
                                            cfg=head.layer, attention_backend=attention_backend, tp=None,
                                            decode_only=decode_only)
    return normed, out, kv_cache


def forward_dense(params: dict, head: Eagle3Config, embeds: jax.Array, hidden: jax.Array):
    """Cache-free causal forward for training: embeds, hidden [B, L, D] -> (final-normed, pre-norm) [B, L, D]."""
    batch, length, d = embeds.shape
    cfg, lp = head.layer, params["layer"]
    x, residual = _layer_inputs(params, head, embeds.reshape(-1, d), hidden.reshape(-1, d))
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q, k, v = llama._qkv(lp, cfg, x, jnp.tile(jnp.arange(length, dtype=jnp.int32), batch), inv_freq)
    attn = layers.causal_attention(*(a.reshape(batch, length, *a.shape[1:]) for a in (q, k, v)),
                                   sm_scale=cfg.head_dim ** -0.5)
    normed, out = llama._out_and_mlp(lp, cfg, residual, attn.reshape(batch * length, *attn.shape[2:]),
                                     params["final_norm"])
    return normed.reshape(batch, length, d), out.reshape(batch, length, d)


def _fill(params, target_params, batch: ModelBatch, aux, kv_caches, next_tokens, num_accepted, rows, *, cfg,
          attention_backend, tp):
    """eagle_head._fill over fc(aux states [T, n * D]) -> (caches, the head's input at each sampling row's
    last accepted position [M, D])."""
    shifted = jnp.concatenate([batch.token_ids[1:], batch.token_ids[:1]])
    tokens = jnp.where(next_tokens >= 0, next_tokens, shifted)
    batch = batch._replace(token_ids=tokens, slot_mapping=jnp.where(next_tokens == -2, 0, batch.slot_mapping))
    hidden = features(params, aux)
    step = _replicated(tp, lambda p, e, h, b, c: forward(p, cfg, e, h, b, c, attention_backend)[2], 5)
    return [step(params, embed(params, target_params, tokens), hidden, batch, kv_caches[0])], hidden[
        rows[3] + num_accepted]


fill = jax.jit(_fill, static_argnames=("cfg", "attention_backend", "tp"), donate_argnames=("kv_caches",))


def _propose(params, target_params, batch_tables, hidden, kv_caches, tokens, num_accepted, rows, *, cfg, k: int,
             block_size: int, attention_backend: str, tp):
    """eagle_head._propose with the head's own lm head over the draft vocabulary, mapped through d2t; each step
    after the first reads the previous one's pre-norm output -> (caches, drafts [M, k] of target ids, zero past R)."""
    num_rows = tokens.shape[0]
    hidden, tokens, num_accepted, rows = first_rows(batch_tables.shape[0], hidden, tokens, num_accepted, rows)
    batch_row, base, capacity = rows[0], rows[1], rows[2]
    block_tables = batch_tables[batch_row]
    positions = base - 1 + num_accepted  # each row's last accepted position
    kv_cache = kv_caches[0]
    step = _replicated(tp, lambda p, e, h, b, c: forward(p, cfg, e, h, b, c, attention_backend, decode_only=True), 5)
    drafts = []
    for _ in range(k):
        batch = decode_batch(tokens, positions, capacity, block_tables, block_size)
        normed, hidden, kv_cache = step(params, embed(params, target_params, tokens), hidden, batch, kv_cache)
        tokens = params["d2t"][jnp.argmax(logits(params, normed), axis=-1)]
        drafts.append(tokens)
        positions = positions + 1
    return [kv_cache], stack_drafts(drafts, num_rows)


def _fill_propose(params, target_params, batch: ModelBatch, aux, kv_caches, next_tokens, num_accepted, rows, tokens,
                  *, cfg, k: int, block_size: int, attention_backend: str, tp):
    """fill, then propose from the head inputs it gives, as one program (a step that samples)."""
    kv_caches, hidden = _fill(params, target_params, batch, aux, kv_caches, next_tokens, num_accepted, rows, cfg=cfg,
                              attention_backend=attention_backend, tp=tp)
    return _propose(params, target_params, batch.block_tables, hidden, kv_caches, tokens, num_accepted, rows, cfg=cfg,
                    k=k, block_size=block_size, attention_backend=attention_backend, tp=tp)


fill_propose = jax.jit(_fill_propose, static_argnames=("cfg", "k", "block_size", "attention_backend", "tp"),
                       donate_argnames=("kv_caches",))
