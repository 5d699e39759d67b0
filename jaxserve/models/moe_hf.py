"""The mixture-of-experts families' Hugging Face side (Mixtral, Qwen2-MoE, Qwen3-MoE): config.json <->
LlamaConfig with its MoeSpec, the checkpoint's tensor names, and the `FAMILY` object the registry maps
them onto. The model is llama.py's decoder, whose MoE layers run moe.py's block (models/family.py).

Config (HF field -> ours):
    Mixtral    num_local_experts (or num_experts), num_experts_per_tok; experts use intermediate_size; every layer is
               MoE; top-k always renormalised; routing weights float32; sliding_window as Mistral
    Qwen2-MoE  num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob (default
               false), decoder_sparse_step, mlp_only_layers, shared_expert_intermediate_size with a
               sigmoid gate; qkv_bias (default true); dense layers use intermediate_size
    Qwen3-MoE  as Qwen2-MoE without the shared expert (transformers 5 writes num_experts as
               num_local_experts); per-head q/k norm; attention_bias (q/k/v and o_proj biases)
A layer i is MoE iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule).
A field missing from config.json takes the default of transformers' config class.
Router fields of other MoE families that change numerics and are not implemented (`scoring_func`
other than softmax, `topk_method` other than greedy, grouped top-k, `routed_scaling_factor`) are
refused by name.

Tensors of MoE layer i (`p` = "model.layers.{i}."; HF weights are [out, in], ours `x @ W`):
    Mixtral    p + "block_sparse_moe.gate.weight" [E, D]           -> router [D, E]
               p + "block_sparse_moe.experts.{e}.w1|w3.weight" [F, D] -> we_gate_up[e, :, 0|1, :]
               p + "block_sparse_moe.experts.{e}.w2.weight" [D, F]  -> we_down[e]
    Qwen*-MoE  p + "mlp.gate.weight", p + "mlp.experts.{e}.gate_proj|up_proj|down_proj.weight"
               p + "mlp.shared_expert.gate_proj|up_proj|down_proj.weight" -> ws_gate, ws_up, ws_down
               p + "mlp.shared_expert_gate.weight" [1, D]           -> shared_gate [D]
    fused      p + "mlp.experts.gate_up_proj" [E, 2F, D] (gate rows first), p + "mlp.experts.down_proj"
               [E, D, F]: transformers' in-memory layout, used instead of the per-expert tensors
               when a checkpoint holds it (Mixtral's router is then p + "mlp.gate.weight").
The per-expert layout is the one written back (loader.save_safetensors).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models import llama_hf
from jaxserve.models.family import HFTensor, UnsupportedModelError
from jaxserve.models.llama import LlamaConfig
from jaxserve.models.moe import MoeSpec

# The architectures and HF's model_type of each.
ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}

# Fields of other MoE families' configs that change the routing numerics; with a value other than
# the one given here the checkpoint is refused rather than run with the plain softmax top-k router.
_ROUTER_FIELDS = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


def _int(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise ValueError(f"missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _num_experts(hf: dict[str, Any], default: int) -> int:
    """transformers reads `num_experts` and `num_local_experts` as one field (Mixtral's and Qwen3-MoE's
    attribute_map) and writes either, depending on the class and version."""
    both = {key: _int(hf, key) for key in ("num_experts", "num_local_experts") if hf.get(key) is not None}
    if len(set(both.values())) > 1:
        raise ValueError(f"num_experts and num_local_experts disagree: {both}")
    return next(iter(both.values()), default)


def _switches(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The LlamaConfig fields an MoE architecture sets (`moe`, attention switches, sliding_window).
    Raises ValueError naming the field for anything not implemented."""
    for key, plain in _ROUTER_FIELDS.items():
        if hf.get(key) is not None and hf[key] != plain:
            raise ValueError(f"{key}={hf[key]!r} is not supported (only {plain!r}): jaxserve implements the "
                             f"softmax top-k router of {arch}")
    if arch == "MixtralForCausalLM":
        # router_jitter_noise only perturbs training inputs.
        spec = MoeSpec(num_experts=_num_experts(hf, 8), top_k=_int(hf, "num_experts_per_tok", 2),
                       intermediate_size=_int(hf, "intermediate_size"),
                       sparse_layers=tuple(range(_int(hf, "num_hidden_layers"))),
                       norm_topk_prob=True, float32_weights=True)
        return {"moe": spec, "sliding_window": hf.get("sliding_window")}
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true is not supported for {arch}; set it to false")
    num_layers = _int(hf, "num_hidden_layers")
    num_experts = _num_experts(hf, 60 if arch == "Qwen2MoeForCausalLM" else 128)
    step = _int(hf, "decoder_sparse_step", 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    qwen2 = arch == "Qwen2MoeForCausalLM"
    spec = None if not sparse else MoeSpec(  # no MoE layer: a dense model
        num_experts=num_experts, top_k=_int(hf, "num_experts_per_tok", 4 if qwen2 else 8),
        intermediate_size=_int(hf, "moe_intermediate_size", 1408 if qwen2 else 768), sparse_layers=sparse,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), float32_weights=False,
        shared_intermediate_size=_int(hf, "shared_expert_intermediate_size", 5632) if qwen2 else 0)
    if qwen2:
        return {"moe": spec, "qkv_bias": bool(hf.get("qkv_bias", True))}
    bias = bool(hf.get("attention_bias", False))
    return {"moe": spec, "qk_norm": True, "qkv_bias": bias, "o_bias": bias}


def config_from_hf(hf: dict[str, Any], dtype: str = "auto", source: str = "config.json",
                   architecture: str = "MixtralForCausalLM") -> LlamaConfig:
    """Map a parsed HF config.json of `architecture` (one of ARCHITECTURES) onto LlamaConfig with its
    MoeSpec, refusing what we do not implement."""
    try:
        switches = _switches(architecture, hf)
    except ValueError as err:
        raise UnsupportedModelError(f"{source}: {err}") from None
    return llama_hf.llama_config(hf, dtype, source, architecture, **switches)


def to_hf_config(cfg: LlamaConfig, **extra: Any) -> dict[str, Any]:
    """The config.json describing `cfg` (the inverse of config_from_hf). A config the architecture's
    config.json cannot express (e.g. a Mixtral with a dense layer, a shared expert outside Qwen2-MoE, or
    routing weights in the other dtype) is refused, naming the fields that would read back otherwise."""
    arch, spec = cfg.architecture, cfg.moe
    hf = llama_hf.hf_fields(cfg, ARCHITECTURES[arch])
    if arch == "MixtralForCausalLM":
        del hf["attention_bias"]  # Mixtral's attention has no biases
        if spec is not None:
            hf |= {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.top_k}
    else:
        hf |= {"use_sliding_window": False, "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i in range(cfg.num_layers) if spec is None or i not in spec.sparse_layers]}
        if spec is not None:
            hf |= {"num_experts": spec.num_experts, "num_experts_per_tok": spec.top_k,
                   "moe_intermediate_size": spec.intermediate_size, "norm_topk_prob": spec.norm_topk_prob}
        if arch == "Qwen2MoeForCausalLM":
            del hf["attention_bias"]
            hf["qkv_bias"] = cfg.qkv_bias
            if spec is not None:
                hf["shared_expert_intermediate_size"] = spec.shared_intermediate_size
    try:
        back = config_from_hf(hf, dtype=cfg.dtype, architecture=arch)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"this {arch} config has no config.json form: {err}") from None
    differ = [f.name for f in dataclasses.fields(cfg) if getattr(back, f.name) != getattr(cfg, f.name)]
    if differ:
        raise UnsupportedModelError(
            f"a {arch} config.json cannot express this config: {', '.join(differ)} would read back as "
            f"{', '.join(repr(getattr(back, name)) for name in differ)} (not "
            f"{', '.join(repr(getattr(cfg, name)) for name in differ)})")
    return hf | extra


def _moe_layer_table(cfg: LlamaConfig, layer: int, names: frozenset[str]) -> dict[str, HFTensor]:
    """HF tensor name -> where it goes, for MoE layer `layer`'s MLP (module docstring). `names`: the
    checkpoint's tensor names, which choose between the per-expert and the fused layout."""
    spec: MoeSpec = cfg.moe
    d, e, f = cfg.hidden_size, spec.num_experts, spec.intermediate_size
    p = f"model.layers.{layer}."
    mixtral = cfg.architecture == "MixtralForCausalLM"
    block = p + ("mlp." if not mixtral or p + "mlp.gate.weight" in names else "block_sparse_moe.")

    def at(name: str, shape: tuple[int, ...], stack_index: int | tuple | None = None) -> HFTensor:
        return HFTensor(("layers", layer, name), shape, True, stack_index)

    table = {block + "gate.weight": at("router", (e, d))}
    if block + "experts.gate_up_proj" in names or block + "experts.down_proj" in names:
        # [E, 2F, D] -> [E, D, 2F] -> [E, D, 2, F]: the gate rows come first, so index 0 of the 2 is gate
        table |= {block + "experts.gate_up_proj": at("we_gate_up", (e, 2 * f, d)),
                  block + "experts.down_proj": at("we_down", (e, d, f))}
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for x in range(e):
            table |= {f"{block}experts.{x}.{gate}.weight": at("we_gate_up", (f, d), (x, slice(None), 0)),
                      f"{block}experts.{x}.{up}.weight": at("we_gate_up", (f, d), (x, slice(None), 1)),
                      f"{block}experts.{x}.{down}.weight": at("we_down", (d, f), x)}
    if spec.shared_intermediate_size:
        s = spec.shared_intermediate_size
        table |= {block + "shared_expert.gate_proj.weight": at("ws_gate", (s, d)),
                  block + "shared_expert.up_proj.weight": at("ws_up", (s, d)),
                  block + "shared_expert.down_proj.weight": at("ws_down", (d, s)),
                  block + "shared_expert_gate.weight": at("shared_gate", (1, d))}
    return table


def hf_tensor_table(cfg: LlamaConfig, names: frozenset[str] | None = None) -> dict[str, HFTensor]:
    """HF tensor name -> where it goes in our params: the Llama family's table with each MoE layer's
    dense MLP tensors replaced by its MoE block's. `names` (the checkpoint's tensor names) picks the
    per-expert or the fused expert layout; without them, the per-expert one."""
    table = llama_hf.hf_tensor_table(cfg)
    for i in cfg.moe.sparse_layers if cfg.moe is not None else ():
        for name in ("gate_proj", "up_proj", "down_proj"):
            del table[f"model.layers.{i}.mlp.{name}.weight"]
        table |= _moe_layer_table(cfg, i, names or frozenset())
    return table


FAMILY = dataclasses.replace(llama_hf.FAMILY, name="llama-moe", config_from_hf=config_from_hf,
                             to_hf_config=to_hf_config, hf_tensor_table=hf_tensor_table)
