"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE).

HF parity of their logits and of the engine's greedy tokens runs in test_model_parity.py and
test_engine_parity.py (every fixture directory). Here:
- the block's stages (route, dispatch, experts_ffn, combine, shared expert) against a per-token
  numpy loop over the experts, for each family's routing rules;
- loading: per-expert and fused tensor layouts give the same params, experts split across
  safetensors files, save_safetensors round trip, and refused inputs (missing expert tensor, router
  variants that are not implemented, contradicting fields);
- tensor parallelism: each expert's columns sharded like the dense MLP (padded where uneven), the
  step equal to the unsharded one with no extra collective, and engine tokens equal to HF's;
- to_hf_config: every fixture's config reads back unchanged; what config.json cannot express is refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.models import llama, loader, moe, registry
from jaxserve.models.loader import CheckpointError
from jaxserve.models.moe import MoeSpec
from jaxserve.models.registry import UnsupportedModelError
from tests import reference_generate
from tests.conftest import HF_FIXTURES, HF_NAMES
from tests.test_sharding import STEP, hf_engine_tokens, place_params, small_batch, tp
from tests.test_loader import assert_params_equal, edit_config, edit_tensors

MIXTRAL, QWEN2_MOE, QWEN3_MOE = "mixtral_8x2_untied", "qwen2_moe_8x4_shared", "qwen3_moe_8x2_sparse2"


# ---- the block against a dense per-token loop ----
def silu(x):
    return x / (1 + np.exp(-x))


def reference_block(x, lp, spec: MoeSpec):
    """HF's semantics, token by token, in float64."""
    x = x.astype(np.float64)
    p = {k: np.asarray(v, np.float64) for k, v in lp.items()}
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[: spec.top_k]
        weights = probs[t, top] / (probs[t, top].sum() if spec.norm_topk_prob else 1.0)
        for e, w in zip(top, weights):
            gate, up = x[t] @ p["we_gate_up"][e, :, 0], x[t] @ p["we_gate_up"][e, :, 1]
            out[t] += w * ((silu(gate) * up) @ p["we_down"][e])
        if spec.shared_intermediate_size:
            shared = (silu(x[t] @ p["ws_gate"]) * (x[t] @ p["ws_up"])) @ p["ws_down"]
            out[t] += shared / (1 + np.exp(-(x[t] @ p["shared_gate"])))
    return out


def normal(seed, shape, dtype=jnp.float32, std=1.0):
    # numpy's generator: jax.random compiles one program per shape, which costs more than these tests
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, std, shape).astype(np.float32), dtype)


def random_block(spec: MoeSpec, width=16, seed=0):
    shapes = moe.abstract(spec, width, jnp.float32)
    return {name: normal((seed, i), s.shape, std=1.0 if name == "router" else 0.3)
            for i, (name, s) in enumerate(sorted(shapes.items()))}


def random_params(cfg: llama.LlamaConfig, std: float):
    """llama.init_params' starts (norms 1, biases 0, weights normal), drawn by `normal`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(llama.abstract(cfg))
    out = []
    for i, (path, leaf) in enumerate(leaves):
        init = llama.param_init(path[-1].key)
        out.append(jnp.ones(leaf.shape) if init == "ones" else jnp.zeros(leaf.shape) if init == "zeros"
                   else normal(i, leaf.shape, std=std))
    return jax.tree.unflatten(treedef, out)


SPECS = {
    "mixtral": MoeSpec(num_experts=8, top_k=2, intermediate_size=12, sparse_layers=(0,), float32_weights=True),
    "qwen2_shared": MoeSpec(num_experts=6, top_k=4, intermediate_size=8, sparse_layers=(0,), norm_topk_prob=False,
                            shared_intermediate_size=20),
    "qwen3": MoeSpec(num_experts=16, top_k=3, intermediate_size=8, sparse_layers=(0,)),
}


# 3 tokens leave experts without rows (every spec); 37 give every expert several
@pytest.mark.parametrize("name,tokens", [(name, 3) for name in SPECS] + [("qwen2_shared", 37)])
def test_block_matches_dense_per_token_loop(name, tokens):
    spec = SPECS[name]
    lp = random_block(spec)
    x = normal(tokens, (tokens, 16))
    got = jax.jit(moe.moe_mlp, static_argnames="spec")(lp, x, spec)
    np.testing.assert_allclose(np.asarray(got), reference_block(np.asarray(x), lp, spec), atol=2e-5, rtol=2e-5)


def test_dispatch_groups_copies_by_expert_in_token_order_and_combine_inverts_it():
    ids = jnp.array([[2, 0], [0, 2], [3, 0], [2, 3]], jnp.int32)  # [T=4, k=2]; expert 1 gets nothing
    x = jnp.arange(4, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))
    x_sorted, group_sizes, order = moe.dispatch(x, ids, num_experts=5)
    assert group_sizes.tolist() == [3, 0, 3, 2, 0]
    assert np.asarray(x_sorted)[:, 0].tolist() == [0, 1, 2, 0, 1, 3, 2, 3]  # expert 0: tokens 0, 1, 2; ...
    weights = jnp.array([[0.25, 0.75]] * 4, jnp.float32)
    np.testing.assert_allclose(np.asarray(moe.combine(x_sorted, order, weights, jnp.float32)), np.asarray(x))


def test_experts_ffn_zeroes_rows_past_the_groups():
    spec = SPECS["qwen3"]
    lp = random_block(spec)
    rows = normal(1, (10, 16))
    sizes = jnp.zeros(spec.num_experts, jnp.int32).at[3].set(4).at[7].set(2)  # rows 6..9 belong to no group
    out = np.asarray(moe.experts_ffn(rows, sizes, lp["we_gate_up"], lp["we_down"]))
    assert np.all(out[6:] == 0) and np.all(np.abs(out[:6]).sum(-1) > 0)
    first = jax.nn.silu(rows[:4] @ lp["we_gate_up"][3, :, 0]) * (rows[:4] @ lp["we_gate_up"][3, :, 1])
    np.testing.assert_allclose(out[:4], np.asarray(first @ lp["we_down"][3]), atol=1e-5, rtol=1e-5)


def test_experts_ffn_through_the_pallas_grouped_gemm_equals_ragged_dot():
    """The engine's expert FFN runs the Pallas grouped GEMM where it takes the shapes: the same numbers as
    lax.ragged_dot (here the TPU kernel in interpret mode, the one that runs on a CPU host)."""
    spec = SPECS["qwen3"]
    lp = random_block(spec)
    rows = normal(2, (12, 16))
    sizes = jnp.zeros(spec.num_experts, jnp.int32).at[0].set(5).at[3].set(1).at[6].set(4)  # 2 rows past the groups
    want = moe.experts_ffn(rows, sizes, lp["we_gate_up"], lp["we_down"], backend="reference")
    got = moe.experts_ffn(rows, sizes, lp["we_gate_up"], lp["we_down"], backend="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[10:] == 0)


def test_routing_weight_dtypes_follow_each_family():
    x = normal(0, (5, 16), jnp.bfloat16)
    for name, dtype in [("mixtral", jnp.float32), ("qwen3", jnp.bfloat16)]:
        router = random_block(SPECS[name])["router"].astype(jnp.bfloat16)
        weights, ids = moe.route(x, router, SPECS[name])
        assert weights.dtype == dtype and ids.dtype == jnp.int32
        np.testing.assert_allclose(np.asarray(weights, np.float32).sum(-1), 1.0, atol=1e-2)


# ---- loading ----
def copy_fixture(tmp_path, name=MIXTRAL):
    dst = tmp_path / name
    shutil.copytree(HF_FIXTURES / name, dst)
    return dst


def fuse_experts(tensors: dict, cfg: llama.LlamaConfig) -> None:
    """Rewrite a per-expert checkpoint in transformers' in-memory (fused) layout, in place."""
    mixtral = cfg.architecture == "MixtralForCausalLM"
    old = "block_sparse_moe." if mixtral else "mlp."
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in cfg.moe.sparse_layers:
        p = f"model.layers.{i}."
        tensors[p + "mlp.gate.weight"] = tensors.pop(p + old + "gate.weight")
        parts = [[tensors.pop(f"{p}{old}experts.{e}.{n}.weight") for e in range(cfg.moe.num_experts)]
                 for n in (gate, up, down)]
        tensors[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(*parts[:2])])
        tensors[p + "mlp.experts.down_proj"] = np.stack(parts[2])


@pytest.mark.parametrize("name", [MIXTRAL, QWEN2_MOE])
def test_fused_expert_layout_loads_identically(tmp_path, name):
    path = copy_fixture(tmp_path, name)
    cfg = loader.load_config(path)[0]
    edit_tensors(path, lambda tensors: fuse_experts(tensors, cfg))
    assert_params_equal(loader.load_model(path, "float32").params,
                        loader.load_model(HF_FIXTURES / name, "float32").params)


def test_experts_split_across_files_load_identically(tmp_path):
    path = copy_fixture(tmp_path, QWEN3_MOE)
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)  # each expert's gate_proj and up_proj land in different files
    shards = {"model-00001-of-00002.safetensors": names[0::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, path / fname)
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_params_equal(loader.load_model(path, "float32").params,
                        loader.load_model(HF_FIXTURES / QWEN3_MOE, "float32").params)


@pytest.mark.parametrize("name", [MIXTRAL, QWEN2_MOE])
def test_save_safetensors_writes_the_per_expert_checkpoint(tmp_path, name):
    m = loader.load_model(HF_FIXTURES / name, "float32")
    loader.save_safetensors(m.params, m.config, tmp_path / "model.safetensors")
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(HF_FIXTURES / name / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_config_mapping_per_family():
    mixtral = loader.load_config(HF_FIXTURES / MIXTRAL)[0]
    assert mixtral.moe == MoeSpec(num_experts=8, top_k=2, intermediate_size=16, sparse_layers=(0, 1),
                                  norm_topk_prob=True, float32_weights=True) and mixtral.sliding_window == 24
    qwen2 = loader.load_config(HF_FIXTURES / QWEN2_MOE)[0]
    assert qwen2.moe == MoeSpec(num_experts=8, top_k=4, intermediate_size=32, sparse_layers=(0,),
                                norm_topk_prob=False, shared_intermediate_size=48)
    assert qwen2.qkv_bias and qwen2.intermediate_size == 128  # the dense layer 1 (mlp_only_layers)
    qwen3 = loader.load_config(HF_FIXTURES / QWEN3_MOE)[0]
    assert qwen3.moe == MoeSpec(num_experts=8, top_k=2, intermediate_size=32, sparse_layers=(1,))  # step 2
    assert qwen3.qk_norm and not qwen3.qkv_bias


def test_missing_expert_tensor_is_named(tmp_path):
    path = copy_fixture(tmp_path)
    edit_tensors(path, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        loader.load_model(path)


def test_checkpoint_with_more_experts_than_the_config_is_refused(tmp_path):
    path = copy_fixture(tmp_path, QWEN3_MOE)
    edit_config(path, num_local_experts=7)
    with pytest.raises(CheckpointError, match=r"unexpected tensors model\.layers\.1\.mlp\.experts\.7\."):
        loader.load_model(path)


@pytest.mark.parametrize("changes,match", [
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy' is not supported"),
    ({"n_group": 4, "topk_group": 2}, "n_group=4 is not supported"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5 is not supported"),
    ({"num_experts": 4}, "num_experts and num_local_experts disagree"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be between 1 and the number of experts \(8\)"),
])
def test_router_variants_not_implemented_are_refused(tmp_path, changes, match):
    path = copy_fixture(tmp_path)
    edit_config(path, **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        loader.load_model(path)


def test_qwen_moe_sliding_window_is_refused(tmp_path):
    path = copy_fixture(tmp_path, QWEN2_MOE)
    edit_config(path, use_sliding_window=True, sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window=true is not supported for Qwen2MoeForCausalLM"):
        loader.load_model(path)


def test_bfloat16_runs_close_to_float32():
    low = loader.load_model(HF_FIXTURES / QWEN2_MOE, dtype="bfloat16")
    reference = json.loads((HF_FIXTURES / QWEN2_MOE / "reference.json").read_text())["prompts"][0]
    with np.load(HF_FIXTURES / QWEN2_MOE / "logits.npz") as data:
        high = data["logits_0"][: len(reference)]  # HF's float32 logits over the prompt
    got = reference_generate.greedy_generate(low.params, low.config, [reference], 1).logits[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, high, atol=0.25)
    assert not np.allclose(got, high, atol=1e-4), "the bfloat16 load did not change precision"


# ---- tensor parallelism ----
@pytest.fixture
def fake_devices():
    # checked when a test runs, not at collection, so collecting this module does not start JAX
    if jax.default_backend() != "cpu" or jax.device_count() < 4:
        pytest.skip("the tensor-parallel tests run on fake CPU devices")


needs_fake_devices = pytest.mark.usefixtures("fake_devices")


@needs_fake_devices
def test_sharded_step_matches_unsharded_with_padded_expert_columns_and_no_extra_collective(model=4):
    # expert F = 6 and shared F = 10 divide by neither 4 nor (shared) 4: both padded with zero columns;
    # layer 0 is dense, layer 1 MoE with a shared expert
    spec = MoeSpec(num_experts=4, top_k=2, intermediate_size=6, sparse_layers=(1,), norm_topk_prob=False,
                   shared_intermediate_size=10)
    cfg = llama.LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                            num_kv_heads=4, head_dim=8, max_position_embeddings=64, dtype="float32", qkv_bias=True,
                            moe=spec)
    params = random_params(cfg, std=0.2)
    batch = small_batch()
    expected, _ = STEP(params, cfg, batch, llama.init_kv_caches(cfg, 9, 4))
    t = tp(model)
    placed = place_params(params, cfg, t)
    assert placed["layers"][1]["we_gate_up"].sharding.spec[3] == "model"
    caches = llama.init_kv_caches(cfg, 9, 4, tp=t)
    compiled = STEP.lower(placed, cfg, batch, caches, tp=t).compile()
    kinds = re.findall(r"= \w+\[[\d,]*\][^ ]* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                       r"(?:-start)?\(", compiled.as_text())
    # o and down (dense MLP or MoE block) per layer, the embedding's; the logits' gather
    assert sorted(kinds) == ["all-gather"] + ["all-reduce"] * (2 * cfg.num_layers + 1), kinds
    got, _ = compiled(placed, batch, caches)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


@needs_fake_devices
@pytest.mark.parametrize("name,model", [(QWEN2_MOE, 2)])  # shared expert, an MoE and a dense layer
def test_engine_tensor_parallel_tokens_equal_hf(name, model):
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())["generated"]
    assert hf_engine_tokens(name, model) == reference


@pytest.mark.parametrize("name", HF_NAMES)
def test_to_hf_config_reads_back_as_the_same_config(name):
    cfg = loader.load_config(HF_FIXTURES / name)[0]
    hf = registry.to_hf_config(cfg, bos_token_id=0)
    assert hf["bos_token_id"] == 0
    assert registry.config_from_hf(hf, dtype=cfg.dtype) == cfg


def test_to_hf_config_refuses_what_config_json_cannot_express():
    qwen3 = loader.load_config(HF_FIXTURES / QWEN3_MOE)[0]
    with_shared = dataclasses.replace(qwen3, moe=dataclasses.replace(qwen3.moe, shared_intermediate_size=16))
    with pytest.raises(UnsupportedModelError, match=r"Qwen3MoeForCausalLM config.json cannot express.*: moe would"):
        registry.to_hf_config(with_shared)
    mixtral = loader.load_config(HF_FIXTURES / MIXTRAL)[0]
    one_dense = dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, sparse_layers=(1,)))
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM config.json cannot express"):
        registry.to_hf_config(one_dense)
