"""Local Hugging Face checkpoint directory -> (model config, params pytree, generation defaults).

    config.json --registry.config_from_hf--> LlamaConfig --llama.abstract--> expected tensors
    *.safetensors (+ model.safetensors.index.json) --safe_open(numpy), on the host--> checks
        (every expected tensor present exactly once, shape as expected, nothing unknown left over)
    --transpose to x @ W layout, cast--> jax.device_put (one tensor at a time, with its sharding)

    load_format="dummy" (vLLM's name; benchmarks without a download): config.json only
    --llama.abstract--> every tensor made on the device by a jitted jax.random per shape
    (weights normal * 0.02, norms 1, biases 0; fixed seed), then `place`d like a real one

Only safetensors are read: pickle-based weights (*.bin, *.pt, ...) are refused, and code named in
config.json's `auto_map` is never imported. Every error names the file or tensor at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxserve.models import registry
from jaxserve.models.llama import LlamaConfig, Params, abstract

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Tensors some exporters include that carry nothing we need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0  # dummy weights are the same in every run, so benchmark runs compare like with like
DUMMY_STD = 0.02


class CheckpointError(ValueError):
    """The checkpoint directory is missing something, or holds something we will not load."""


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json (and config.json) say about generation."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # temperature, top_p, top_k, ...


@dataclasses.dataclass
class LoadedModel:
    path: Path
    config: LlamaConfig
    params: Params
    generation: GenerationDefaults
    hf_config: dict[str, Any]


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_config(model_dir: str | os.PathLike, dtype: str = "auto") -> tuple[LlamaConfig, dict[str, Any]]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model path {model_dir} is not a directory; pass a local Hugging Face checkpoint directory")
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{model_dir} has no config.json; a Hugging Face checkpoint directory needs one")
    hf = read_json(config_path)
    try:
        cfg = registry.config_from_hf(hf, dtype=dtype, source=str(config_path))
    except registry.UnsupportedModelError as err:
        if hf.get("auto_map"):
            raise registry.UnsupportedModelError(
                f"{err}. The config names custom code (auto_map); jaxserve never imports checkpoint code"
            ) from None
        raise
    return cfg, hf


def read_generation_defaults(model_dir: Path, hf: dict[str, Any]) -> GenerationDefaults:
    gen = read_json(model_dir / "generation_config.json") if (model_dir / "generation_config.json").exists() else {}

    def ids(value) -> tuple[int, ...]:
        if value is None:
            return ()
        return tuple(int(v) for v in (value if isinstance(value, list) else [value]))

    eos = ids(gen.get("eos_token_id", hf.get("eos_token_id")))
    sampling = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                    "max_new_tokens") if gen.get(k) is not None}
    if gen.get("do_sample") is False:
        sampling["temperature"] = 0.0
    bos = gen.get("bos_token_id", hf.get("bos_token_id"))
    pad = gen.get("pad_token_id", hf.get("pad_token_id"))
    return GenerationDefaults(eos, None if bos is None else int(bos), None if isinstance(pad, list) or pad is None
                              else int(pad), sampling)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (from the index, or by listing single files)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no 'weight_map' object")
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for fpath in sorted(set(files.values())):
            if not fpath.exists():
                raise CheckpointError(f"{index_path} names {fpath.name}, which is not in {model_dir}")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{model_dir} holds only pickle-based weights ({', '.join(pickles)}); jaxserve loads safetensors "
                "only, because unpickling can run arbitrary code. Convert them to safetensors first "
                "(e.g. load with transformers and call save_pretrained(dir, safe_serialization=True))"
            )
        raise CheckpointError(f"{model_dir} has no *.safetensors weight files")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            for name in f.keys():
                if name in files:
                    raise CheckpointError(f"tensor {name} appears in both {files[name].name} and {shard.name}")
                files[name] = shard
    return files


def hf_tensor_table(cfg: LlamaConfig) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF tensor name -> (path in our params pytree, HF shape, transposed).

    Our layout is `x @ W` with heads split out, so a transposed HF weight [out, in] becomes
    W.T reshaped to our shape (e.g. q_proj [N*H, D] -> wq [D, N, H]); the rest only reshape.
    """
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    table = {
        "model.embed_tokens.weight": (("embed",), (v, d), False),
        "model.norm.weight": (("final_norm",), (d,), False),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), (v, d), True)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        at = ("layers", i)
        table |= {
            p + "input_layernorm.weight": (at + ("attn_norm",), (d,), False),
            p + "post_attention_layernorm.weight": (at + ("mlp_norm",), (d,), False),
            p + "self_attn.q_proj.weight": (at + ("wq",), (n * h, d), True),
            p + "self_attn.k_proj.weight": (at + ("wk",), (k * h, d), True),
            p + "self_attn.v_proj.weight": (at + ("wv",), (k * h, d), True),
            p + "self_attn.o_proj.weight": (at + ("wo",), (d, n * h), True),
            p + "mlp.gate_proj.weight": (at + ("w_gate",), (f, d), True),
            p + "mlp.up_proj.weight": (at + ("w_up",), (f, d), True),
            p + "mlp.down_proj.weight": (at + ("w_down",), (d, f), True),
        }
        if cfg.qkv_bias:
            table |= {p + "self_attn.q_proj.bias": (at + ("bq",), (n * h,), False),
                      p + "self_attn.k_proj.bias": (at + ("bk",), (k * h,), False),
                      p + "self_attn.v_proj.bias": (at + ("bv",), (k * h,), False)}
        if cfg.o_bias:
            table[p + "self_attn.o_proj.bias"] = (at + ("bo",), (d,), False)
        if cfg.mlp_bias:
            table |= {p + "mlp.gate_proj.bias": (at + ("b_gate",), (f,), False),
                      p + "mlp.up_proj.bias": (at + ("b_up",), (f,), False),
                      p + "mlp.down_proj.bias": (at + ("b_down",), (d,), False)}
        if cfg.qk_norm:
            table |= {p + "self_attn.q_norm.weight": (at + ("q_norm",), (h,), False),
                      p + "self_attn.k_norm.weight": (at + ("k_norm",), (h,), False)}
    return table


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_params(model_dir: str | os.PathLike, cfg: LlamaConfig,
                place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> Params:
    """Read and check every tensor on the host, then place each with `place(path, array)`.

    `place` defaults to `jax.device_put` on the default device; sharded loading passes a function
    that puts each tensor straight into its NamedSharding.
    """
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    table = hf_tensor_table(cfg)
    ignorable = {n for n in files if n.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some exporters write the tied head anyway
    missing = sorted(set(table) - set(files))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: missing tensors {shown} (expected by {cfg.architecture} config)")
    extra = sorted(set(files) - set(table) - ignorable)
    if extra:
        shown = ", ".join(f"{n} (in {files[n].name})" for n in extra[:5])
        raise CheckpointError(
            f"{model_dir}: unexpected tensors {shown}{' ...' if len(extra) > 5 else ''}; the config.json does not "
            f"describe them, so the checkpoint and config disagree"
        )

    place = place or (lambda _path, array: jax.device_put(array))
    np_dtype = NP_DTYPES[cfg.dtype]
    shapes = abstract(cfg)
    params: Params = jax.tree.map(lambda _: None, shapes)
    by_file: dict[Path, list[str]] = {}
    for name in table:
        by_file.setdefault(files[name], []).append(name)
    for fpath, names in sorted(by_file.items()):
        with safe_open(fpath, framework="numpy") as f:
            for name in names:
                path, hf_shape, transposed = table[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != hf_shape:
                    raise CheckpointError(
                        f"tensor {name} in {fpath.name} has shape {list(shape)}, expected {list(hf_shape)} "
                        f"from config.json"
                    )
                array = f.get_tensor(name)
                array = (array.T if transposed else array).reshape(_get(shapes, path).shape)
                _set(params, path, place(path, np.ascontiguousarray(array.astype(np_dtype))))
    return params


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    # NOTE: one compilation per distinct shape (about ten for a whole model); the float32 draw is
    # fused with the cast, so an 8B model is made on the device in seconds with no host copy.
    return (DUMMY_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def dummy_params(cfg: LlamaConfig, place: Callable[[tuple, jax.Array], jax.Array] | None = None) -> Params:
    """Random params with exactly the shapes and dtypes `load_params` gives: weights normal * 0.02,
    norms 1, biases 0, from a fixed seed. Each tensor is made on the default device, then `place`d."""
    place = place or (lambda _path, array: array)
    root = jax.random.key(DUMMY_SEED)
    leaves, treedef = jax.tree.flatten_with_path(abstract(cfg))
    out = []
    for index, (keys, leaf) in enumerate(leaves):
        name = str(keys[-1].key)
        if name.endswith("norm"):
            array = jnp.ones(leaf.shape, leaf.dtype)
        elif name.startswith("b"):
            array = jnp.zeros(leaf.shape, leaf.dtype)
        else:
            array = _random_normal(jax.random.fold_in(root, index), leaf.shape, leaf.dtype)
        out.append(place(tuple(k.key if hasattr(k, "key") else k.idx for k in keys), array))
    return jax.tree.unflatten(treedef, out)


def load_model(model_dir: str | os.PathLike, dtype: str = "auto",
               place: Callable[[tuple, np.ndarray | jax.Array], jax.Array] | None = None,
               load_format: str = "auto") -> LoadedModel:
    """`load_format`: auto reads the safetensors; dummy needs only config.json (random weights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = Path(model_dir)
    cfg, hf = load_config(model_dir, dtype)
    params = dummy_params(cfg, place) if load_format == "dummy" else load_params(model_dir, cfg, place)
    return LoadedModel(model_dir, cfg, params, read_generation_defaults(model_dir, hf), hf)


def save_safetensors(params: Params, cfg: LlamaConfig, path: str | os.PathLike) -> None:
    """Write params back in HF names and layout (the inverse of load_params), e.g. after training."""
    from safetensors.numpy import save_file

    tensors = {}
    for name, (ppath, hf_shape, transposed) in hf_tensor_table(cfg).items():
        array = np.asarray(_get(params, ppath))
        tensors[name] = np.ascontiguousarray(
            array.reshape(hf_shape[::-1]).T if transposed else array.reshape(hf_shape))
    save_file(tensors, str(path), metadata={"format": "pt"})
