"""Local Hugging Face checkpoint directory -> (model config, params pytree, generation defaults).

    config.json --registry.config_from_hf--> the family's config --family.hf_tensor_table--> expected tensors
    *.safetensors (+ model.safetensors.index.json) --safe_open(numpy), on the host--> checks
        (every expected tensor present exactly once, shape as expected, nothing unknown left over)
    --transpose to x @ W layout, cast--> `place` (one leaf at a time, with its sharding; a leaf stacked
        from several tensors, e.g. experts, once all of its parts are read)

FP8 weights (the config's `quantization`, models/quant.py): a pre-quantized checkpoint's float8_e4m3fn
`weight` and its scale tensor become one Fp8Weight leaf (its `input_scale` is not used); with online
quantization (`quantization="fp8"` on a float checkpoint) each weight is quantized on the host as soon as
it is read, so only one full-precision tensor is held at a time.

    load_format="dummy" (vLLM's name; benchmarks without a download): config.json only
    --family.abstract--> every tensor made on the device by a jitted jax.random per shape
    (as family.param_init says: weights normal * 0.02, norms 1, biases 0; fixed seed), then `place`d

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

from jaxserve.models import quant, registry

Params = Any  # a family's params pytree

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Tensors some exporters include that carry nothing we need; and an fp8 KV cache's scales, which
# models/kv_scales.py reads when the cache is fp8.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale")
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
    config: Any  # the family's model config (models/family.py ModelConfig)
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


QUANTIZATIONS = (None, "fp8")


def load_config(model_dir: str | os.PathLike, dtype: str = "auto",
                quantization: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The model config of a checkpoint directory and its parsed config.json. `quantization="fp8"` quantizes
    a float checkpoint's weights at load (a checkpoint whose config.json has a quantization_config already
    holds FP8 weights and loads them either way)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
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
    if quantization == "fp8" and getattr(cfg, "quantization", None) is None:
        if not registry.family_of(cfg).quantized:
            raise registry.UnsupportedModelError(f"quantization='fp8' is not supported for {cfg.architecture}; "
                                                 "leave quantization unset")
        try:
            cfg = dataclasses.replace(cfg, quantization=quant.QuantSpec("online"))
        except ValueError as err:
            raise registry.UnsupportedModelError(f"quantization='fp8': {err}") from None
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


def _read_raw(fpath: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file read from its bytes (safetensors' numpy reader has no float8)."""
    with open(fpath, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_size))[name]
        start, end = info["data_offsets"]
        f.seek(8 + header_size + start)
        data = f.read(end - start)
    return np.frombuffer(data, RAW_DTYPES[info["dtype"]]).reshape(info["shape"])


RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def _read_fp8(cfg: Any, f, files: dict[str, Path], name: str, like: quant.Fp8Weight, n_in: int) -> quant.Fp8Weight:
    """The Fp8Weight leaf of checkpoint weight `name` (safetensors file `f`): quantized from the float
    tensor (online), or read with its scale tensor (pre-quantized)."""
    spec = cfg.quantization
    dtype = f.get_slice(name).get_dtype()
    if spec.checkpoint == "online":
        array = np.swapaxes(f.get_tensor(name), -1, -2).reshape(like.q.shape)
        return quant.quantize(array.astype(NP_DTYPES[cfg.dtype]), n_in)
    if dtype != "F8_E4M3":
        raise CheckpointError(f"tensor {name} in {files[name].name} has dtype {dtype}; quantization_config "
                              f"({spec.checkpoint}) needs float8_e4m3fn (F8_E4M3) weights")
    scale_name = name.removesuffix("weight") + spec.scale_name
    try:
        return quant.from_checkpoint(spec, _read_raw(files[name], name), _read_raw(files[scale_name], scale_name),
                                     like, n_in, scale_name)
    except KeyError as err:
        raise CheckpointError(f"tensor {scale_name} has dtype {err}, which is not a float type") from None
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_params(model_dir: str | os.PathLike, cfg: Any,
                place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> Params:
    """Read and check every tensor on the host, then place each leaf with `place(path, array)`.

    `place` defaults to `jax.device_put` on the default device; sharded loading passes a function
    that puts each tensor straight into its NamedSharding (family.param_placer).
    """
    model_dir = Path(model_dir)
    family = registry.family_of(cfg)
    files = weight_files(model_dir)
    table = family.hf_tensor_table(cfg, frozenset(files))
    ignorable = {n for n in files if n.endswith(IGNORED_SUFFIXES)}
    if getattr(cfg, "tie_word_embeddings", False):
        ignorable.add("lm_head.weight")  # some exporters write the tied head anyway
    shapes = family.abstract(cfg)
    expected = set(table)
    spec = getattr(cfg, "quantization", None)
    if spec is not None and spec.checkpoint != "online":
        fp8 = [name for name, entry in table.items() if isinstance(_get(shapes, entry.path), quant.Fp8Weight)]
        expected |= {name.removesuffix("weight") + spec.scale_name for name in fp8}
        ignorable |= {name.removesuffix("weight") + "input_scale" for name in fp8}  # activations stay unquantized
    missing = sorted(expected - set(files))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: missing tensors {shown} (expected by {cfg.architecture} config)")
    extra = sorted(set(files) - expected - ignorable)
    if extra:
        shown = ", ".join(f"{n} (in {files[n].name})" for n in extra[:5])
        raise CheckpointError(
            f"{model_dir}: unexpected tensors {shown}{' ...' if len(extra) > 5 else ''}; the config.json does not "
            f"describe them, so the checkpoint and config disagree"
        )

    place = place or (lambda _path, array: jax.device_put(array))
    np_dtype = NP_DTYPES[cfg.dtype]
    params: Params = jax.tree.map(lambda _: None, shapes)
    # Stacked leaves (HFTensor.stack_index) are assembled on the host: leaf path -> (buffer, parts left).
    stacks: dict[tuple, list] = {}
    for entry in table.values():
        if entry.stack_index is not None:
            stacks.setdefault(entry.path, [None, 0])[1] += 1
    by_file: dict[Path, list[str]] = {}
    for name in table:
        by_file.setdefault(files[name], []).append(name)
    for fpath, names in sorted(by_file.items()):
        with safe_open(fpath, framework="numpy") as f:
            for name in names:
                entry = table[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != entry.shape:
                    raise CheckpointError(
                        f"tensor {name} in {fpath.name} has shape {list(shape)}, expected {list(entry.shape)} "
                        f"from config.json"
                    )
                like = _get(shapes, entry.path)
                if isinstance(like, quant.Fp8Weight) and entry.stack_index is None:
                    weight = _read_fp8(cfg, f, files, name, like, family.quantized[entry.path[-1]])
                    _set(params, entry.path, place(entry.path, weight))
                    continue
                if f.get_slice(name).get_dtype().startswith("F8"):
                    raise CheckpointError(f"tensor {name} in {fpath.name} is float8 ({f.get_slice(name).get_dtype()}) "
                                          f"but config.json has no quantization_config that describes it")
                array = f.get_tensor(name)
                array = np.swapaxes(array, -1, -2) if entry.transposed else array
                leaf_shape = like.shape
                if entry.stack_index is None:
                    _set(params, entry.path, place(entry.path, np.ascontiguousarray(
                        array.reshape(leaf_shape).astype(np_dtype))))
                    continue
                stack = stacks[entry.path]
                if stack[0] is None:
                    stack[0] = np.empty(leaf_shape, np_dtype)
                stack[0][entry.stack_index] = array.reshape(stack[0][entry.stack_index].shape)
                stack[1] -= 1
                if stack[1] == 0:
                    _set(params, entry.path, place(entry.path, stack[0]))
                    stack[0] = None
    return params


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    # NOTE: one compilation per distinct shape (about ten for a whole model); the float32 draw is
    # fused with the cast, so an 8B model is made on the device in seconds with no host copy.
    return (DUMMY_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def dummy_params(cfg: Any, place: Callable[[tuple, jax.Array], jax.Array] | None = None) -> Params:
    """Random params with exactly the shapes and dtypes `load_params` gives, started as the family's
    `param_init` says (weights normal * 0.02), from a fixed seed. Each tensor is made on the default
    device, then `place`d."""
    family = registry.family_of(cfg)
    place = place or (lambda _path, array: array)
    root = jax.random.key(DUMMY_SEED)
    is_fp8 = lambda node: isinstance(node, quant.Fp8Weight)  # noqa: E731
    leaves, treedef = jax.tree.flatten_with_path(family.abstract(cfg), is_leaf=is_fp8)
    out = []
    for index, (keys, leaf) in enumerate(leaves):
        init = family.param_init(str(keys[-1].key))
        if is_fp8(leaf):
            array = quant.dummy(jax.random.fold_in(root, index), leaf, DUMMY_STD)
        elif init == "ones":
            array = jnp.ones(leaf.shape, leaf.dtype)
        elif init == "zeros":
            array = jnp.zeros(leaf.shape, leaf.dtype)
        else:
            array = _random_normal(jax.random.fold_in(root, index), leaf.shape, leaf.dtype)
        out.append(place(tuple(k.key if hasattr(k, "key") else k.idx for k in keys), array))
    return jax.tree.unflatten(treedef, out)


def load_model(model_dir: str | os.PathLike, dtype: str = "auto",
               place: Callable[[tuple, np.ndarray | jax.Array], jax.Array] | None = None,
               load_format: str = "auto", tp=None, quantization: str | None = None) -> LoadedModel:
    """`load_format`: auto reads the safetensors; dummy needs only config.json (random weights).
    `tp` (a sharding.TensorParallel): place each tensor into its sharding on that mesh, as the model's
    family says (its param_placer); else `place`, or the default device. `quantization`: load_config's."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = Path(model_dir)
    cfg, hf = load_config(model_dir, dtype, quantization)
    if tp is not None:
        place = registry.family_of(cfg).param_placer(tp)
    params = dummy_params(cfg, place) if load_format == "dummy" else load_params(model_dir, cfg, place)
    return LoadedModel(model_dir, cfg, params, read_generation_defaults(model_dir, hf), hf)


def save_safetensors(params: Params, cfg: Any, path: str | os.PathLike) -> None:
    """Write params back in HF names and layout (the inverse of load_params), e.g. after training."""
    from safetensors.numpy import save_file

    if getattr(cfg, "quantization", None) is not None:
        raise ValueError("save_safetensors writes float weights; these params hold FP8 weights (quantization)")
    tensors = {}
    for name, entry in registry.family_of(cfg).hf_tensor_table(cfg).items():
        array = np.asarray(_get(params, entry.path))
        if entry.stack_index is not None:
            array = array[entry.stack_index]
        if entry.transposed:  # ours is HF's with the last two axes swapped
            ours = (*entry.shape[:-2], entry.shape[-1], entry.shape[-2])
            array = np.swapaxes(array.reshape(ours), -1, -2)
        tensors[name] = np.ascontiguousarray(array.reshape(entry.shape))
    save_file(tensors, str(path), metadata={"format": "pt"})
