"""The interface of a model family: what the loader, the checkpoint code and the runner call.

A family is one `ModelFamily` object (registry.py maps HF architecture strings onto families). Its
model config is a frozen, hashable dataclass (it is a static argument of the jitted step) with at least
the fields of `ModelConfig`; everything else about the model stays inside the family's own module.

    config_from_hf(hf, dtype, source, architecture) -> config   HF config.json (parsed) -> our config; refuses
                                                                what the family does not implement with
                                                                UnsupportedModelError naming field and value
    to_hf_config(config, **extra) -> dict                       the inverse (writing a trained model)
    abstract(config) -> params pytree of jax.ShapeDtypeStruct   every parameter's shape and dtype
    param_init(leaf_name) -> "normal" | "ones" | "zeros"        how random params start (dummy weights, training)
    hf_tensor_table(config, names=None) -> {HF tensor name: HFTensor}   where each checkpoint tensor goes in
                                                                the params. `names`: the tensor names the
                                                                checkpoint holds (the loader passes them), for a
                                                                family whose checkpoints come in more than one
                                                                layout to pick the one present; None (writing a
                                                                checkpoint) gives the family's canonical layout
    param_placer(tp) -> place(path, array) -> jax.Array         each tensor straight into its tensor-parallel
                                                                sharding (loader and checkpoint restore)
    forward(params, config, batch, kv_caches, attention_backend, tp, decode_only, comm, return_hidden=False)
        -> (float32 logits [num_logits, V], kv_caches)          one engine step over a ragged ModelBatch;
           (+ final-normed hidden states [T, D] with return_hidden, for prompt log-probs); the runner passes
           flash_prefill_threshold=N (> 0 only) for runner.flash_prefill_token_threshold
           (layers.paged_attention's long-prefill path)
    head_logits(params, config, hidden [..., D]) -> float32 logits [..., V]   the lm head alone
    init_kv_caches(config, num_blocks, block_size, attention_backend, dtype=None, tp=None) -> list of arrays
    forward_dense(params, config, token_ids [B, T]) -> logits [B, T, V]   optional: cache-free, for training
    init_params(config, key, std) -> params                     optional: random params, as param_init says
    quantized: {leaf name: input axes}                          optional: the weights that may be FP8
                                                                (models/quant.py Fp8Weight leaves)

This module imports no JAX: it only states the contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or a config value jaxserve does not implement."""


class ModelConfig(Protocol):
    """The fields of a family's config that code outside the family reads (KV-cache sizing, buckets,
    the sampler's vocabulary, attention kernels)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str  # float32 | bfloat16 | float16

    @property
    def jnp_dtype(self) -> Any: ...


class HFTensor(NamedTuple):
    """Where one checkpoint tensor goes. HF stores linear weights as [out, in] (stacked ones, e.g. all experts
    in one tensor, as [..., out, in]); our params are `x @ W`, so a `transposed` tensor has its last two axes
    swapped, then is reshaped to the leaf's shape (or to the shape of its part of the leaf).

    With `stack_index`, the tensor is only a part of the leaf: `leaf[stack_index]`, an int (a slice of the
    leaf's first axis, e.g. one expert of a stacked expert weight) or a tuple of ints and slices (numpy
    indexing, e.g. `(e, slice(None), 0)`: expert e's gate half of a fused gate|up weight [E, D, 2, F]). The
    parts of one leaf cover it exactly once; the loader assembles them on the host and places the leaf once
    all of them are read."""

    path: tuple  # the leaf's path in the params pytree, e.g. ("layers", 3, "wq")
    shape: tuple[int, ...]  # the tensor's shape in the checkpoint
    transposed: bool
    stack_index: int | tuple | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One family of architectures behind one implementation (see the module docstring for each field)."""

    name: str
    config_from_hf: Callable[..., Any]
    to_hf_config: Callable[..., dict[str, Any]]
    abstract: Callable[[Any], Any]
    param_init: Callable[[str], str]
    hf_tensor_table: Callable[..., dict[str, HFTensor]]
    param_placer: Callable[[Any], Callable]
    forward: Callable[..., Any]
    head_logits: Callable[..., Any]
    init_kv_caches: Callable[..., list]
    forward_dense: Callable[..., Any] | None = None
    init_params: Callable[..., Any] | None = None
    # The leaves FP8 weights apply to (by name) and the number of leading input axes of each; empty: the
    # family has no FP8 weights. Its config then carries `quantization` (a models/quant.QuantSpec or None).
    quantized: dict[str, int] = dataclasses.field(default_factory=dict)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_scaling(hf: dict[str, Any], source: str) -> tuple[float, tuple | None]:
    """(rope_theta, hashable rope-scaling params) from either HF naming scheme (shared by the families).

    Hub checkpoints use `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"{source}: rope_scaling must be an object, got {params!r}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope_type {rope_type!r}; jaxserve supports {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    needed = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed[rope_type] if k not in params]
    if missing:
        raise UnsupportedModelError(f"{source}: rope_type {rope_type!r} needs {missing} in rope_scaling")
    kept = {"rope_type": rope_type, **{k: params[k] for k in needed[rope_type]}}
    return theta, tuple(sorted(kept.items()))
