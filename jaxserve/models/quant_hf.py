"""config.json's `quantization_config` -> QuantSpec (models/quant.py), refusing every setting jaxserve does
not honour by its field and value.

    compressed-tensors  quant_method "compressed-tensors", format float-quantized (or naive-quantized),
                        quantization_status compressed; config_groups whose `weights` are 8-bit float,
                        symmetric, static, strategy tensor | channel | block (block_structure [bo, bi]);
                        targets ["Linear"]; input_activations 8-bit float, dynamic per token or static per
                        tensor (accepted: the reference path runs activations unquantized); no
                        output_activations, no kv_cache_scheme, no sparsity; ignore: lm_head only.
                        Tensors: `weight` float8_e4m3fn, `weight_scale`, optional `input_scale`.
    fp8                 quant_method "fp8" (vLLM's Fp8Config, HF's FineGrainedFP8Config), fmt e4m3,
                        activation_scheme dynamic | static, weight_block_size [bo, bi] or none (then one
                        `weight_scale` per tensor); ignored_layers / modules_to_not_convert: lm_head only.
                        Tensors: `weight` float8_e4m3fn, `weight_scale_inv` (block) or `weight_scale`,
                        optional `input_scale`.
In both formats the scale is multiplied: weight = fp8 value * scale.
"""

from __future__ import annotations

from typing import Any

from jaxserve.models.family import UnsupportedModelError
from jaxserve.models.quant import QuantSpec

QUANT_METHODS = ("compressed-tensors", "fp8")
# Module names an ignore list may hold: what jaxserve keeps in the model dtype anyway.
UNQUANTIZED_MODULES = ("lm_head", "re:.*lm_head", "model.embed_tokens")


def _refuse(source: str, field: str, value: Any, supported: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: quantization_config.{field}={value!r} is not supported; {supported}")


def _check_ignore(qc: dict[str, Any], field: str, source: str) -> None:
    ignore = qc.get(field) or []
    if not isinstance(ignore, list):
        raise _refuse(source, field, ignore, "give a list of module names")
    others = [name for name in ignore if name not in UNQUANTIZED_MODULES]
    if others:
        raise _refuse(source, field, others, f"jaxserve quantizes every linear layer of the decoder, so only "
                      f"{list(UNQUANTIZED_MODULES)} may be left unquantized")


def _block(value: Any, source: str, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(source, field, value, "give two positive block sizes [out, in], e.g. [128, 128]")
    return (value[0], value[1])


def _fp8(qc: dict[str, Any], source: str) -> QuantSpec:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(source, "fmt", qc["fmt"], "FP8 weights must be e4m3 (float8_e4m3fn)")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _refuse(source, "activation_scheme", qc["activation_scheme"], "use dynamic or static")
    for field in ("ignored_layers", "modules_to_not_convert"):
        _check_ignore(qc, field, source)
    block = _block(qc.get("weight_block_size"), source, "weight_block_size")
    return QuantSpec("fp8", block, "weight_scale_inv" if block is not None else "weight_scale")


def _float8(args: Any, where: str, source: str) -> None:
    if not isinstance(args, dict):
        raise _refuse(source, where, args, "give an object")
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _refuse(source, where, {k: args.get(k) for k in ("type", "num_bits")},
                      "jaxserve loads 8-bit float (FP8 e4m3) quantization only")
    if args.get("symmetric", True) is not True:
        raise _refuse(source, f"{where}.symmetric", args["symmetric"], "FP8 scales are symmetric")


def _weights_scheme(weights: Any, where: str, source: str) -> tuple:
    _float8(weights, where, source)
    if weights.get("dynamic", False):
        raise _refuse(source, f"{where}.dynamic", weights["dynamic"], "weights must have static scales")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(source, f"{where}.strategy", strategy, "use tensor, channel or block")
    block = _block(weights.get("block_structure"), source, f"{where}.block_structure") if strategy == "block" else None
    if strategy == "block" and block is None:
        raise _refuse(source, f"{where}.block_structure", None, "strategy block needs [out, in] block sizes")
    return strategy, block


def _compressed_tensors(qc: dict[str, Any], source: str) -> QuantSpec:
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise _refuse(source, "format", qc.get("format"), "jaxserve loads float-quantized FP8 checkpoints")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(source, "quantization_status", qc["quantization_status"],
                      "the weights must be stored quantized (compressed)")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(field):
            raise _refuse(source, field, qc[field], "leave it null (jaxserve quantizes weights only)")
    _check_ignore(qc, "ignore", source)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(source, "config_groups", groups, "give one group of FP8 weights targeting Linear")
    schemes = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise _refuse(source, where, group, "give an object")
        if group.get("targets") != ["Linear"]:
            raise _refuse(source, f"{where}.targets", group.get("targets"), "jaxserve quantizes ['Linear'] as a whole")
        if group.get("output_activations"):
            raise _refuse(source, f"{where}.output_activations", group["output_activations"], "leave it null")
        acts = group.get("input_activations")
        if acts is not None:
            _float8(acts, f"{where}.input_activations", source)
            if (acts.get("strategy"), bool(acts.get("dynamic"))) not in (("token", True), ("tensor", False),
                                                                          ("tensor", True)):
                raise _refuse(source, f"{where}.input_activations.strategy", acts.get("strategy"),
                              "use dynamic per-token or per-tensor, or static per-tensor activation scales")
        schemes.add(_weights_scheme(group.get("weights"), f"{where}.weights", source))
    if len(schemes) > 1:
        raise _refuse(source, "config_groups", sorted(groups), "all groups must quantize weights the same way")
    (_, block), = schemes
    return QuantSpec("compressed-tensors", block, "weight_scale")


def spec_from_hf(qc: Any, source: str) -> QuantSpec:
    """The QuantSpec of a checkpoint's quantization_config (module docstring), or UnsupportedModelError."""
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    raise _refuse(source, "quant_method", method, f"jaxserve loads FP8 checkpoints of quant_method "
                  f"{list(QUANT_METHODS)} (or quantizes a float checkpoint at load: quantization='fp8')")
