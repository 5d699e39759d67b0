"""The mixture-of-experts benchmark configs (Qwen3-30B-A3B and Mixtral-8x7B shapes, the Qwen3 MoE's dense
peer) resolve to the intended shapes on the CPU with no weights, and the bench roofline counts the experts
a decode step touches."""

from __future__ import annotations

import pytest

from jaxserve.bench import common
from jaxserve.config import load_config
from jaxserve.models import loader
from tests.conftest import ROOT

CONFIGS = ROOT / "configs"


def model_config(yaml_name: str):
    config = load_config(CONFIGS / yaml_name)
    assert config.model.load_format == "dummy" and config.model.skip_tokenizer_init
    assert config.runner.token_buckets[0] == 1  # decode steps run T == B: no padding rows routed
    cfg, _ = loader.load_config(config.model.path, config.model.dtype)
    return config, cfg


@pytest.fixture(scope="module")
def qwen3_moe():
    return model_config("qwen3-30b-a3b-dummy.yaml")[1]


@pytest.fixture(scope="module")
def dense_peer():
    return model_config("qwen3-30b-a3b-dense-peer-dummy.yaml")[1]


def test_qwen3_30b_a3b_shape(qwen3_moe):
    cfg = qwen3_moe
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.dtype, cfg.qk_norm, cfg.tie_word_embeddings) == (
        "Qwen3MoeForCausalLM", 2048, 48, 32, 4, 128, 151936, "bfloat16", True, False)
    spec = cfg.moe
    assert (spec.num_experts, spec.top_k, spec.intermediate_size, spec.norm_topk_prob) == (128, 8, 768, True)
    assert spec.sparse_layers == tuple(range(48))
    roof = common.roofline(cfg, batch=1, mean_context=0)
    assert roof["weight_bytes"] == 61_064_245_248  # 30.5B parameters in bf16
    assert roof["expert_bytes"] == 48 * 128 * 3 * 2048 * 768 * 2
    assert roof["one_expert_bytes"] == 3 * 2048 * 768 * 2


def test_dense_peer_reads_what_the_moe_reads_at_batch_1(qwen3_moe, dense_peer):
    """Same attention, embedding and layers; its dense MLP (6144 = 8 x 768) holds exactly the 8 routed
    experts' parameters, so the MoE's batch-1 step reads the peer's weights plus its routers."""
    peer = dense_peer
    assert peer.architecture == "Qwen3ForCausalLM" and peer.moe is None
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "qk_norm",
                  "rope_theta", "rms_norm_eps", "tie_word_embeddings", "dtype"):
        assert getattr(peer, field) == getattr(qwen3_moe, field), field
    assert peer.intermediate_size == qwen3_moe.moe.top_k * qwen3_moe.moe.intermediate_size
    dense = common.roofline(peer, batch=1, mean_context=100)
    moe = common.roofline(qwen3_moe, batch=1, mean_context=100)
    routers = 48 * 2048 * 128 * 2
    assert moe["read_weight_bytes"] == dense["weight_bytes"] + routers
    assert moe["kv_bytes_per_token"] == dense["kv_bytes_per_token"] == 48 * 2 * 4 * 128 * 2


def test_mixtral_8x7b_shape():
    _, cfg = model_config("mixtral-8x7b-dummy.yaml")
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == ("MixtralForCausalLM", 4096, 32, 32, 8, 128, 32000)
    spec = cfg.moe
    assert (spec.num_experts, spec.top_k, spec.intermediate_size, spec.float32_weights) == (8, 2, 14336, True)
    roof = common.roofline(cfg, batch=1, mean_context=0)
    assert roof["weight_bytes"] == 93_405_585_408  # 46.7B parameters in bf16
    assert roof["experts_touched_per_layer"] == pytest.approx(2.0)


def test_experts_touched_formula():
    e, k = 128, 8
    assert common.expected_experts_touched(e, k, 1) == pytest.approx(k)
    # two rows: k each, minus the expected overlap k * k / E
    assert common.expected_experts_touched(e, k, 2) == pytest.approx(2 * k - k * k / e)
    assert common.expected_experts_touched(e, k, 512) == pytest.approx(e, rel=1e-12)
    assert common.expected_experts_touched(8, 8, 3) == pytest.approx(8)  # top-k of all: every expert
    counts = [common.expected_experts_touched(e, k, b) for b in (1, 4, 16, 64, 256)]
    assert counts == sorted(counts) and counts[-1] <= e


def test_moe_roofline_bytes(qwen3_moe):
    """bytes per step = non-expert weights + layers x touched experts x one expert + KV."""
    cfg = qwen3_moe
    for batch in (1, 8, 64):
        roof = common.roofline(cfg, batch=batch, mean_context=576)
        touched = common.expected_experts_touched(128, 8, batch)
        assert roof["experts_touched_per_layer"] == pytest.approx(touched)
        assert roof["touched_expert_bytes"] == pytest.approx(48 * touched * roof["one_expert_bytes"])
        non_expert = roof["weight_bytes"] - roof["expert_bytes"]
        step = non_expert + roof["touched_expert_bytes"] + batch * 576 * roof["kv_bytes_per_token"]
        assert roof["bytes_per_step"] == pytest.approx(step)
        assert roof["tokens_per_s"] == pytest.approx(batch * common.HBM_BYTES_PER_S / step)
    # at batch 64 nearly every expert is touched (128 * (1 - (15/16)^64) ~ 125.6): most of the 61 GB
    assert common.roofline(cfg, batch=64, mean_context=0)["read_weight_bytes"] > 0.95 * 61e9


def test_dense_roofline_unchanged(dense_peer):
    roof = common.roofline(dense_peer, batch=4, mean_context=10)
    assert roof["read_weight_bytes"] == roof["weight_bytes"]
    assert "touched_expert_bytes" not in roof
    assert roof["bytes_per_step"] == roof["weight_bytes"] + 4 * 10 * roof["kv_bytes_per_token"]
