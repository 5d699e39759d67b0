"""Generate tiny Hugging Face reference fixtures for the JAX model tests.

Produces, under ``tests/fixtures/hf/<name>/`` for nine tiny random-weight
float32 models (Llama / Mistral / Qwen2 / Qwen3 variants, and the mixture-of-experts
Mixtral / Qwen2-MoE / Qwen3-MoE):

* ``config.json``, ``model.safetensors``, ``generation_config.json`` written by
  ``model.save_pretrained(..., safe_serialization=True)``; the generation
  config has ``bos_token_id=0``, ``eos_token_id=1``, ``pad_token_id=0``.
* ``reference.json``: 3 seeded random prompts (lengths 5, 17, 33, ids in
  ``[2, vocab)``), the 40 greedy tokens HF ``generate`` produced for each
  (EOS disabled), the minimum top-1/top-2 logit margin over the generated
  positions, library versions and notes.
* ``logits.npz``: ``logits_<i>`` = float32 teacher-forced logits
  ``[len(prompt_i) + 40, vocab]`` over prompt + generated tokens.

Every parameter is re-initialised from a seeded generator (2-D weights and
stacked expert weights ~ N(0, std), router weights ~ N(0, ROUTER_STD), norm
weights ~ 1 + U(-0.2, 0.2), biases ~ N(0, 0.1)), so the output is
deterministic: running the script twice yields byte-identical files.

MoE fixtures also require a clear top-k choice at every router: the gap between
the k-th and (k+1)-th largest router logit, over every token of every prompt +
generated sequence and every MoE layer, is at least MIN_ROUTER_GAP (prompts are
redrawn otherwise), so float32 rounding cannot flip an expert choice between
implementations. They run HF's reference (eager) expert loop.

Usage: /tmp/venv311/bin/python scripts/make_hf_fixtures.py [NAME ...]   (see README.md)
Without names every fixture is rewritten; with names only those directories are.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
PROMPT_LENS = (5, 17, 33)
NEW_TOKENS = 40
MIN_MARGIN = 1e-3
WEIGHT_STD = 0.15
ROUTER_STD = 1.0  # larger than WEIGHT_STD so the top-k router choices are well separated
MIN_ROUTER_GAP = 1e-3
BOS_ID, EOS_ID, PAD_ID = 0, 1, 0

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    attn_implementation="eager",
    dtype=torch.float32,
)


def rope(theta, **scaling):
    # transformers 5 takes rope settings as one `rope_parameters` dict.
    return dict(rope_parameters=dict(rope_type=scaling.pop("rope_type", "default"), rope_theta=theta, **scaling))


FIXTURES = [
    dict(name="llama3_gqa4_tied", seed=1, model_cls=LlamaForCausalLM, config=LlamaConfig(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        # head_dim 8 -> wavelengths 2*pi*{1, 10, 100, 1000}: 6.3 (< 16, kept), 62.8 (16..64, smoothed),
        # 628 and 6283 (> 64, divided by factor). rope_theta 500000 would leave no entry in the smoothed band.
        **rope(10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64))),
    dict(name="llama2_mha_untied", seed=2, model_cls=LlamaForCausalLM, config=LlamaConfig(
        **{**COMMON, "rms_norm_eps": 1e-5}, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=False, **rope(10000.0))),
    dict(name="mistral_gqa4_untied", seed=3, model_cls=MistralForCausalLM, config=MistralConfig(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        sliding_window=24, **rope(10000.0))),
    dict(name="qwen2_gqa4_tied", seed=4, model_cls=Qwen2ForCausalLM, config=Qwen2Config(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=None, **rope(1000000.0))),
    dict(name="qwen3_gqa1_untied", seed=5, model_cls=Qwen3ForCausalLM, config=Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, **rope(1000000.0))),
    dict(name="qwen3_gqa4_tied", seed=6, model_cls=Qwen3ForCausalLM, config=Qwen3Config(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=None, **rope(1000000.0))),
    # Mixture of experts: HF's eager expert loop is the reference.
    dict(name="mixtral_8x2_untied", seed=7, model_cls=MixtralForCausalLM, config=MixtralConfig(
        **{**COMMON, "intermediate_size": 16}, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, sliding_window=24,
        experts_implementation="eager", **rope(1000000.0))),
    dict(name="qwen2_moe_8x4_shared", seed=8, model_cls=Qwen2MoeForCausalLM, config=Qwen2MoeConfig(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, num_experts=8,
        num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], use_sliding_window=False, experts_implementation="eager",
        **rope(1000000.0))),
    dict(name="qwen3_moe_8x2_sparse2", seed=9, model_cls=Qwen3MoeForCausalLM, config=Qwen3MoeConfig(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=2, use_sliding_window=False, experts_implementation="eager", **rope(1000000.0))),
]


def reinit_(model, seed):
    """Re-initialise every parameter from a seeded generator (nothing left at 0/1 defaults)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name and p.ndim == 1:
                p.copy_(1.0 + (torch.rand(p.shape, generator=gen) * 0.4 - 0.2))
            elif name.endswith("mlp.gate.weight"):  # an MoE router [experts, hidden]
                p.copy_(torch.randn(p.shape, generator=gen) * ROUTER_STD)
            elif p.ndim == 2 or (p.ndim == 3 and ".experts." in name):  # 3-D: stacked expert weights
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
            else:
                raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


def build_model(fx):
    torch.manual_seed(fx["seed"])
    model = fx["model_cls"](fx["config"]).eval()
    reinit_(model, fx["seed"])
    if fx["config"].tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


def greedy_generate(model, prompt):
    """HF cached greedy decoding with EOS disabled; returns (new tokens, per-step logits)."""
    ids = torch.tensor([prompt])
    # generate() fills unset (None) fields of the passed config from model.generation_config, which
    # inherits eos_token_id=1 from the model config; min_new_tokens would then mask token 1 and make
    # generate disagree with the plain forward. So EOS is cleared on the model's config as well.
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=None, pad_token_id=PAD_ID)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               eos_token_id=None, bos_token_id=BOS_ID, pad_token_id=PAD_ID,
                               return_dict_in_generate=True, output_logits=True)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    new = out.sequences[0, len(prompt):].tolist()
    assert len(new) == NEW_TOKENS
    return new, torch.cat(out.logits, dim=0).float()


@torch.no_grad()
def teacher_forced(model, seq):
    return model(torch.tensor([seq])).logits[0].float()


def margins(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def top_k(cfg):
    return getattr(cfg, "num_experts_per_tok", None)


@torch.no_grad()
def router_gap(model, seq):
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and MoE layers."""
    out = model(torch.tensor([seq]), output_router_logits=True)
    k = top_k(model.config)
    gaps = [torch.topk(logits.float(), k + 1, dim=-1).values for logits in out.router_logits]
    assert gaps, "an MoE model recorded no router logits"
    return min((g[:, k - 1] - g[:, k]).min().item() for g in gaps)


def make_reference(model, fx, vocab):
    prompts, generated, min_margins, logits_out, step_diffs = [], [], [], {}, []
    for i, plen in enumerate(PROMPT_LENS):
        for attempt in range(100):
            rng = np.random.default_rng([fx["seed"], i, attempt])
            prompt = rng.integers(2, vocab, size=plen).tolist()
            new, step_logits = greedy_generate(model, prompt)
            logits = teacher_forced(model, prompt + new)
            pred = logits[plen - 1:-1]  # positions that predicted each generated token
            m = margins(pred).min().item()
            gap = router_gap(model, prompt + new) if top_k(model.config) else None
            if gap is not None and gap < MIN_ROUTER_GAP:
                print(f"  prompt {i} attempt {attempt}: router top-k gap {gap:.2e} < {MIN_ROUTER_GAP}, redrawing")
                continue
            if m >= MIN_MARGIN:
                # Near-ties (checked above) are the only legitimate reason for the two HF paths to differ.
                assert pred.argmax(-1).tolist() == new, f"{fx['name']}: cached generate != teacher-forced argmax"
                break
            print(f"  prompt {i} attempt {attempt}: min margin {m:.2e} < {MIN_MARGIN}, redrawing")
        else:
            raise RuntimeError("no prompt with sufficient margin")
        step_diffs.append((step_logits - pred).abs().max().item())
        prompts.append(prompt)
        generated.append(new)
        min_margins.append(m)
        logits_out[f"logits_{i}"] = logits.numpy().astype(np.float32)
        print(f"  prompt {i} (len {plen}, attempt {attempt}): min margin {m:.4f}, "
              f"{len(set(new))} distinct generated tokens, max |cached-forward| logit diff {step_diffs[-1]:.2e}"
              + (f", min router top-k gap {gap:.4f}" if gap is not None else ""))
    return prompts, generated, min_margins, logits_out, max(step_diffs)


def check_llama3_rope(model, cfg):
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    scaled = model.model.rotary_emb.inv_freq.float()
    changed = ~torch.isclose(plain, scaled, rtol=1e-6, atol=0)
    print(f"  llama3 rope: wavelengths {(2 * torch.pi / plain).tolist()}")
    print(f"  llama3 rope: unscaled inv_freq {plain.tolist()}")
    print(f"  llama3 rope: scaled   inv_freq {scaled.tolist()}")
    print(f"  llama3 rope: ratio             {(scaled / plain).tolist()}")
    assert changed.any() and not changed.all(), "llama3 scaling should change some but not all inv_freq"


def check_window_matters(fx, model, seq):
    """The sliding window must change the logits for this sequence length."""
    cfg = fx["model_cls"].config_class.from_dict({**fx["config"].to_dict(), "sliding_window": None})
    cfg._attn_implementation = "eager"
    if top_k(cfg):
        cfg._experts_implementation = "eager"
    full = fx["model_cls"](cfg).eval()
    full.load_state_dict(model.state_dict())
    a, b = teacher_forced(model, seq), teacher_forced(full, seq)
    w = fx["config"].sliding_window
    # MoE experts multiply the rows routed to them together, so a row's rounding depends on the other
    # rows of the sequence: there the positions inside the window agree closely, not bit for bit.
    same = torch.allclose(a[:w], b[:w], rtol=0, atol=1e-5) if top_k(cfg) else torch.equal(a[:w], b[:w])
    assert same, "positions inside the window should be identical"
    diff = (a[w:] - b[w:]).abs().max().item()
    print(f"  sliding window {w}: max logit diff vs no window beyond position {w}: {diff:.3e}")
    assert diff > 1e-3, "sliding window has no effect"


def notes_for(fx, cfg, step_diff):
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    parts = [
        f"{fx['model_cls'].__name__}, float32, eager attention, random weights (seed {fx['seed']}).",
        f"layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} intermediate={cfg.intermediate_size} "
        f"vocab={cfg.vocab_size} heads={cfg.num_attention_heads} kv_heads={cfg.num_key_value_heads} "
        f"head_dim={head_dim} tied={cfg.tie_word_embeddings} rms_norm_eps={cfg.rms_norm_eps} "
        f"rope_parameters={json.dumps(cfg.rope_parameters, sort_keys=True)}.",
        f"Init: 2-D weights ~ N(0, {WEIGHT_STD}), norm weights ~ 1 + U(-0.2, 0.2), biases ~ N(0, 0.1).",
        f"generated = HF greedy generate (KV cache), {NEW_TOKENS} new tokens, EOS disabled; "
        "logits_i = one full forward over prompt + generated (teacher forcing), whose argmax at "
        "positions len(prompt)-1 .. end-2 equals generated.",
        f"max |cached-step logits - teacher-forced logits| over all prompts = {step_diff:.2e}.",
        f"min_margins = min top1-top2 logit gap over the generated positions (required >= {MIN_MARGIN}).",
    ]
    if top_k(cfg):
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        expert_size = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        moe = f"MoE: {experts} experts, top-{cfg.num_experts_per_tok}, expert intermediate={expert_size}"
        if hasattr(cfg, "norm_topk_prob"):
            moe += (f", norm_topk_prob={cfg.norm_topk_prob}, decoder_sparse_step={cfg.decoder_sparse_step}, "
                    f"mlp_only_layers={cfg.mlp_only_layers}")
        if getattr(cfg, "shared_expert_intermediate_size", None):
            moe += f", shared expert intermediate={cfg.shared_expert_intermediate_size} with sigmoid gate"
        parts.append(moe + f"; router weights ~ N(0, {ROUTER_STD}); every router's k-th vs (k+1)-th logit gap "
                     f">= {MIN_ROUTER_GAP} on every sequence; HF eager expert loop.")
    if getattr(cfg, "sliding_window", None):
        parts.append(f"sliding_window={cfg.sliding_window}: query i attends keys j with i-{cfg.sliding_window} < j <= i "
                     "(HF semantics, window includes the query itself); sequences are longer than the window.")
    return " ".join(parts)


def main(names):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    known = [fx["name"] for fx in FIXTURES]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown fixture names {unknown}; choose from {known}")
    selected = [fx for fx in FIXTURES if not names or fx["name"] in names]
    if OUT_DIR.exists():
        for child in OUT_DIR.iterdir():
            if child.is_dir() and (not names or child.name in names):
                shutil.rmtree(child)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for fx in selected:
        print(f"== {fx['name']}")
        model = build_model(fx)
        cfg = model.config
        if cfg.rope_parameters.get("rope_type") == "llama3":
            check_llama3_rope(model, cfg)
        prompts, generated, min_margins, logits, step_diff = make_reference(model, fx, cfg.vocab_size)
        if getattr(cfg, "sliding_window", None):
            check_window_matters(fx, model, prompts[-1] + generated[-1])

        out = OUT_DIR / fx["name"]
        model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        model.save_pretrained(out, safe_serialization=True)
        np.savez_compressed(out / "logits.npz", **logits)
        reference = {
            "prompts": prompts,
            "generated": generated,
            "min_margins": min_margins,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "notes": notes_for(fx, cfg, step_diff),
        }
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in reference.items()]  # one key per line
        (out / "reference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
        print(f"  wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
