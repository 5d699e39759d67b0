"""HF `architectures` string -> model module, and HF config.json -> our frozen model config.

Unsupported architectures and field values are refused here with a message naming the field,
the value and what is supported, so no checkpoint is ever half understood.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jaxserve.models import llama
from jaxserve.models.llama import DTYPES, LlamaConfig

# Per-architecture switches of the one Llama-family implementation.
_LLAMA_FAMILY = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
ARCHITECTURES: dict[str, ModuleType] = {name: llama for name in _LLAMA_FAMILY}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or a config value jaxserve does not implement."""


def model_module(architecture: str) -> ModuleType:
    return ARCHITECTURES[architecture]


def _architecture(hf: dict[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UnsupportedModelError(
            f"{source}: 'architectures' is missing or empty; expected one of {sorted(ARCHITECTURES)}"
        )
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"{source}: unsupported architecture {archs}; jaxserve supports {sorted(ARCHITECTURES)}"
    )


def _rope_scaling(hf: dict[str, Any], source: str) -> tuple[float, tuple | None]:
    """(rope_theta, hashable rope-scaling params) from either HF naming scheme.

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


def config_from_hf(hf: dict[str, Any], dtype: str = "auto", source: str = "config.json") -> LlamaConfig:
    """Map a parsed HF config.json onto LlamaConfig, refusing what we do not implement."""
    arch = _architecture(hf, source)
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in hf]
    if missing:
        raise UnsupportedModelError(f"{source}: missing required fields {missing}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is implemented")
    if hf.get("quantization_config"):
        raise UnsupportedModelError(f"{source}: quantized checkpoints (quantization_config) are not supported yet")
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported for Qwen2; set it to false")
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError(f"{source}: sliding-window attention is not supported for {arch}")

    if dtype == "auto":
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)} or 'auto'")

    num_heads = hf["num_attention_heads"]
    theta, scaling = _rope_scaling(hf, source)
    switches = dict(_LLAMA_FAMILY[arch])
    if arch in ("LlamaForCausalLM", "MistralForCausalLM") and hf.get("attention_bias"):
        switches |= {"qkv_bias": True, "o_bias": True}
    if arch == "Qwen3ForCausalLM" and hf.get("attention_bias"):
        switches["qkv_bias"] = True
    sliding_window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=sliding_window,
            dtype=dtype,
            architecture=arch,
            **switches,
        )
    except ValueError as err:
        raise UnsupportedModelError(f"{source}: {err}") from None


def to_hf_config(cfg: LlamaConfig, **extra: Any) -> dict[str, Any]:
    """The config.json describing `cfg` (the inverse of config_from_hf), e.g. for a trained model."""
    hf: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.o_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": "silu",
        "torch_dtype": cfg.dtype,
    }
    return hf | extra
