"""The Llama family's Hugging Face side: config.json <-> LlamaConfig, checkpoint tensor names, and the
`FAMILY` object the registry maps Llama, Mistral, Qwen2 and Qwen3 onto (models/family.py).

A `quantization_config` (pre-quantized FP8 checkpoints) becomes the config's QuantSpec (models/quant_hf.py).
Unsupported field values are refused here with a message naming the field, the value and what is
supported, so no checkpoint is ever half understood.
"""

from __future__ import annotations

from typing import Any

from jaxserve.models import llama, quant_hf
from jaxserve.models.family import HFTensor, ModelFamily, UnsupportedModelError, rope_scaling
from jaxserve.models.llama import DTYPES, LlamaConfig

# Per-architecture switches of the one Llama-family implementation, and HF's model_type of each.
VARIANTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def config_from_hf(hf: dict[str, Any], dtype: str = "auto", source: str = "config.json",
                   architecture: str = "LlamaForCausalLM") -> LlamaConfig:
    """Map a parsed HF config.json of `architecture` (one of VARIANTS) onto LlamaConfig, refusing what we
    do not implement."""
    arch = architecture
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported for Qwen2; set it to false")
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError(f"{source}: sliding-window attention is not supported for {arch}")
    switches = dict(VARIANTS[arch])
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":  # HF: q/k/v and o_proj biases
        switches |= {"qkv_bias": True, "o_bias": True}
    sliding_window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
    return llama_config(hf, dtype, source, arch, sliding_window=sliding_window, **switches)


def llama_config(hf: dict[str, Any], dtype: str, source: str, arch: str, **switches: Any) -> LlamaConfig:
    """The LlamaConfig of the fields every architecture run by llama.py shares (sizes, rope, norm, dtype,
    tied head), plus `switches`: the LlamaConfig fields the architecture's own mapping decided. A
    ValueError from the config's checks is refused as UnsupportedModelError naming `source`."""
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in hf]
    if missing:
        raise UnsupportedModelError(f"{source}: missing required fields {missing}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is implemented")
    quantization = quant_hf.spec_from_hf(hf["quantization_config"], source) if hf.get("quantization_config") else None

    if dtype == "auto":
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)} or 'auto'")

    num_heads = hf["num_attention_heads"]
    theta, scaling = rope_scaling(hf, source)
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
            dtype=dtype,
            architecture=arch,
            quantization=quantization,
            **switches,
        )
    except ValueError as err:
        raise UnsupportedModelError(f"{source}: {err}") from None


def to_hf_config(cfg: LlamaConfig, **extra: Any) -> dict[str, Any]:
    """The config.json describing `cfg` (the inverse of config_from_hf), e.g. for a trained model."""
    return hf_fields(cfg, MODEL_TYPES[cfg.architecture]) | extra


def hf_fields(cfg: LlamaConfig, model_type: str) -> dict[str, Any]:
    """The config.json fields of what `llama_config` reads (the inverse of it)."""
    return {
        "architectures": [cfg.architecture],
        "model_type": model_type,
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
    } | ({"sliding_window": cfg.sliding_window} if cfg.sliding_window else {})


def hf_tensor_table(cfg: LlamaConfig, names: frozenset[str] | None = None) -> dict[str, HFTensor]:
    """HF tensor name -> where it goes in our params (one layout: `names` is not needed).

    Our layout is `x @ W` with heads split out, so a transposed HF weight [out, in] becomes
    W.T reshaped to our shape (e.g. q_proj [N*H, D] -> wq [D, N, H]); the rest only reshape.
    """
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    table = {
        "model.embed_tokens.weight": HFTensor(("embed",), (v, d), False),
        "model.norm.weight": HFTensor(("final_norm",), (d,), False),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = HFTensor(("lm_head",), (v, d), True)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def at(name: str, shape: tuple[int, ...], transposed: bool) -> HFTensor:
            return HFTensor(("layers", i, name), shape, transposed)  # noqa: B023 - used within this iteration

        table |= {
            p + "input_layernorm.weight": at("attn_norm", (d,), False),
            p + "post_attention_layernorm.weight": at("mlp_norm", (d,), False),
            p + "self_attn.q_proj.weight": at("wq", (n * h, d), True),
            p + "self_attn.k_proj.weight": at("wk", (k * h, d), True),
            p + "self_attn.v_proj.weight": at("wv", (k * h, d), True),
            p + "self_attn.o_proj.weight": at("wo", (d, n * h), True),
            p + "mlp.gate_proj.weight": at("w_gate", (f, d), True),
            p + "mlp.up_proj.weight": at("w_up", (f, d), True),
            p + "mlp.down_proj.weight": at("w_down", (d, f), True),
        }
        if cfg.qkv_bias:
            table |= {p + "self_attn.q_proj.bias": at("bq", (n * h,), False),
                      p + "self_attn.k_proj.bias": at("bk", (k * h,), False),
                      p + "self_attn.v_proj.bias": at("bv", (k * h,), False)}
        if cfg.o_bias:
            table[p + "self_attn.o_proj.bias"] = at("bo", (d,), False)
        if cfg.mlp_bias:
            table |= {p + "mlp.gate_proj.bias": at("b_gate", (f,), False),
                      p + "mlp.up_proj.bias": at("b_up", (f,), False),
                      p + "mlp.down_proj.bias": at("b_down", (d,), False)}
        if cfg.qk_norm:
            table |= {p + "self_attn.q_norm.weight": at("q_norm", (h,), False),
                      p + "self_attn.k_norm.weight": at("k_norm", (h,), False)}
    return table


FAMILY = ModelFamily(
    name="llama",
    config_from_hf=config_from_hf,
    to_hf_config=to_hf_config,
    abstract=llama.abstract,
    param_init=llama.param_init,
    hf_tensor_table=hf_tensor_table,
    param_placer=llama.param_placer,
    forward=llama.forward,
    head_logits=llama.head_logits,
    init_kv_caches=llama.init_kv_caches,
    forward_dense=llama.forward_dense,
    init_params=llama.init_params,
    quantized=llama.QUANTIZED,
)
