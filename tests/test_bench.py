"""`--load-format dummy`, `jaxserve bench throughput | latency`, the step-record report and the tight-loop
decode peer, on tiny shapes (speed is never asserted: benchmarks/RESULTS.md holds the figures)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.bench import common
from jaxserve.cli import main as cli_main
from jaxserve.config import load_config
from jaxserve.models import loader
from jaxserve.step_stats import StepStats
from tests import reference_generate
from tests.conftest import HF_FIXTURES, ROOT

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
FIXTURE = HF_FIXTURES / "llama3_gqa4_tied"


@pytest.fixture
def config_only_dir(tmp_path):
    """A checkpoint directory holding only config.json: no weights, tokenizer or generation_config."""
    shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
    return tmp_path


@pytest.mark.parametrize("name, dtype", [("llama2_mha_untied", "float32"), ("qwen2_gqa4_tied", "bfloat16"),
                                         ("qwen3_gqa4_tied", "float32")])
def test_dummy_params_match_the_real_loader(name, dtype):
    real = loader.load_model(HF_FIXTURES / name, dtype=dtype)
    dummy = loader.load_model(HF_FIXTURES / name, dtype=dtype, load_format="dummy")
    assert dummy.config == real.config
    assert jax.tree.structure(dummy.params) == jax.tree.structure(real.params)
    for ours, theirs in zip(jax.tree.leaves(dummy.params), jax.tree.leaves(real.params)):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
    layer = dummy.params["layers"][0]
    assert np.all(np.asarray(layer["attn_norm"], np.float32) == 1.0)
    assert 0.015 < float(np.std(np.asarray(layer["w_up"], np.float32))) < 0.025
    assert ("bq" in layer) == name.startswith("qwen2")  # Qwen2 has q/k/v biases: zeros, as the loader's rule
    if "bq" in layer:
        assert not np.any(np.asarray(layer["bq"], np.float32))


def test_dummy_load_needs_only_config_json_and_repeats(config_only_dir):
    first = loader.load_model(config_only_dir, load_format="dummy")
    second = loader.load_model(config_only_dir, load_format="dummy")
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert first.generation.eos_token_ids == (1,)  # from config.json, with no generation_config.json
    with pytest.raises(ValueError, match="load_format"):
        loader.load_model(config_only_dir, load_format="pt")
    with pytest.raises(ValueError, match="model.load_format"):
        load_config(None, load_format="safetensors")


def test_engine_greedy_on_dummy_weights_matches_the_oracle(config_only_dir):
    llm = LLM(model=config_only_dir, load_format="dummy", dtype="float32", skip_tokenizer_init=True,
              max_model_len=64, block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
              token_buckets=[16], request_buckets=[4], precompile=False, progress=False)
    prompts = [[5, 9, 200, 17, 3], [42, 1, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    oracle = reference_generate.greedy_generate(llm.engine.model.params, llm.engine.model.config, prompts, 6,
                                                keep_logits=False)
    assert [out.outputs[0].token_ids for out in outputs] == oracle.tokens


def test_llama3_8b_dummy_config_resolves_the_model_shape():
    config = load_config(ROOT / "configs" / "llama3-8b-dummy.yaml")
    assert config.model.load_format == "dummy" and config.model.skip_tokenizer_init
    cfg, _ = loader.load_config(config.model.path, config.model.dtype)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size, cfg.dtype) == (4096, 32, 32, 8, 128, 14336, 128256, "bfloat16")
    roofline = common.roofline(cfg, batch=64, mean_context=2048)
    assert roofline["weight_bytes"] == 16_060_522_496  # 8.03B parameters in bf16
    assert roofline["kv_bytes_per_token"] == 131_072


def test_step_report_by_hand():
    def step(k, t_start, dispatch, done, t_end, tokens, prefill):
        return StepStats(k, tokens, tokens - prefill + (1 if prefill else 0), prefill, t_start, 0.001, 0.002,
                         dispatch, readback_s=0.003, update_s=0.004, done_t=done, t_end=t_end)

    steps = [step(0, 0.0, 0.1, 0.5, 0.6, tokens=8, prefill=8),  # prefill only: no ITL sample
             step(1, 0.6, 0.7, 0.9, 1.0, tokens=2, prefill=0),  # 2 decode rows, 0.4 s after step 0
             step(2, 0.9, 0.85, 1.1, 1.1, tokens=3, prefill=0)]  # dispatched before step 1 finished
    report = common.step_report([steps])
    assert report["num_steps"] == 3 and report["num_prefill_steps"] == 1
    itl = report["itl_ms"]
    assert itl["count"] == 5 and itl["mean"] == pytest.approx((2 * 400 + 3 * 100) / 5)
    # device: 0.4 (0.1 -> 0.5), 0.2 (0.7 -> 0.9), 0.2 (0.9 -> 1.1); idle 0.2 (0.5 -> 0.7) of the 1.0 s from 0.1 to 1.1
    assert report["breakdown_ms"]["device"] == pytest.approx(800 / 3)
    assert report["breakdown_ms"]["update"] == pytest.approx(4.0)
    assert report["device_idle_share"] == pytest.approx(0.2)
    assert report["mean_decode_rows_per_step"] == pytest.approx(2.5)


def bench(tmp_path, *argv) -> dict:
    out = tmp_path / "report.json"
    assert cli_main(["bench", *argv, "--output-json", str(out), "--disable-tqdm", "--precompile", "false"]) == 0
    return json.loads(out.read_text())


SHARED_FIELDS = {"ttft_ms", "tpot_ms", "steps", "engine", "roofline", "roofline_share"}


def check_summary(stats: dict, count: int) -> None:
    """A percentile summary: `count` samples, non-negative, percentiles in order, the mean within range."""
    assert stats["count"] == count
    assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert 0 <= stats["mean"] <= stats["max"]


def check_roofline(roofline: dict, model, batch: float, mean_context: float) -> None:
    """The roofline's bytes are the tiny model's weights plus the batch's KV (float32, 4 layers, 2 KV heads)."""
    cfg = model.config
    assert roofline["weight_bytes"] == sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    assert roofline["kv_bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert (roofline["batch"], roofline["mean_context"]) == (batch, mean_context)
    step_bytes = roofline["weight_bytes"] + batch * mean_context * roofline["kv_bytes_per_token"]
    assert roofline["bytes_per_step"] == step_bytes
    assert roofline["tokens_per_s"] == pytest.approx(batch * roofline["bandwidth_bytes_per_s"] / step_bytes)


def test_bench_throughput_on_the_embedded_model(tmp_path, tiny_model):
    report = bench(tmp_path, "throughput", "--config", str(TINY_CONFIG), "--num-prompts", "6", "--input-len", "5",
                   "--output-len", "4")
    assert SHARED_FIELDS | {"requests_per_s", "total_tokens_per_s", "output_tokens_per_s"} <= set(report)
    assert report["num_requests"] == 6 and report["total_output_tokens"] == 24 and report["total_prompt_tokens"] == 30
    elapsed = report["elapsed_s"]
    assert report["requests_per_s"] == pytest.approx(6 / elapsed)
    assert report["output_tokens_per_s"] == pytest.approx(24 / elapsed)
    assert report["total_tokens_per_s"] == pytest.approx((30 + 24) / elapsed)
    check_summary(report["ttft_ms"], 6)
    check_summary(report["tpot_ms"], 6)  # every request has 4 >= 2 output tokens
    assert report["ttft_ms"]["max"] <= elapsed * 1e3
    assert report["engine"]["num_compiled"] == 0 and report["engine"]["startup_compile_s"] >= 0
    assert report["engine"]["num_preemptions"] == 0  # 512 blocks hold every request
    steps = report["steps"]
    # every prompt token and every output token but the last is fed to the model once
    assert steps["num_steps"] * steps["mean_tokens_per_step"] == 30 + 6 * 3
    assert steps["num_prefill_steps"] >= 1 and steps["mean_decode_rows_per_step"] == 6  # the 6 decode together
    check_summary(steps["itl_ms"], 6 * 3)  # 3 decode tokens per request
    assert set(steps["breakdown_ms"]) == {"schedule", "prepare", "device", "readback", "update"}
    assert all(value >= 0 for value in steps["breakdown_ms"].values())
    assert 0.0 <= steps["device_idle_share"] <= 1.0
    check_roofline(report["roofline"], tiny_model, batch=6, mean_context=5 + 4 / 2)
    assert report["roofline_share"] == pytest.approx(report["output_tokens_per_s"] / report["roofline"]["tokens_per_s"])


def test_bench_throughput_dummy_weights_from_a_dataset(tmp_path, config_only_dir):
    dataset = tmp_path / "requests.jsonl"
    dataset.write_text('{"prompt_token_ids": [1, 2, 3], "output_len": 2}\n\n{"prompt_token_ids": [4, 5]}\n')
    report = bench(tmp_path, "throughput", "--config", str(TINY_CONFIG), "--model", str(config_only_dir),
                   "--load-format", "dummy", "--skip-tokenizer-init", "--dataset-path", str(dataset),
                   "--output-len", "3")
    assert report["num_requests"] == 2 and report["total_output_tokens"] == 5
    assert report["engine"]["config"]["model"]["load_format"] == "dummy"


def test_bench_latency_on_the_embedded_model(tmp_path, tiny_model):
    report = bench(tmp_path, "latency", "--config", str(TINY_CONFIG), "--batch-size", "2", "--input-len", "4",
                   "--output-len", "3", "--num-iters-warmup", "1", "--num-iters", "2")
    assert SHARED_FIELDS | {"latency_ms", "latencies_s", "decode_tokens_per_s"} <= set(report)
    latencies = report["latencies_s"]
    assert len(latencies) == 2 and all(t > 0 for t in latencies)  # the timed iterations only
    check_summary(report["latency_ms"], 2)
    assert report["latency_ms"]["mean"] == pytest.approx(np.mean(latencies) * 1e3)
    assert report["latency_ms"]["max"] == pytest.approx(max(latencies) * 1e3)
    check_summary(report["ttft_ms"], 2 * 2)  # batch x iterations
    check_summary(report["tpot_ms"], 2 * 2)
    steps = report["steps"]
    # per timed iteration: the 2 prompts (4 tokens each), then 2 decode tokens each
    assert steps["num_steps"] * steps["mean_tokens_per_step"] == 2 * (2 * 4 + 2 * 2)
    assert steps["num_prefill_steps"] == 2  # one per iteration: both prompts fit one step
    check_summary(steps["itl_ms"], 2 * 2 * 2)
    assert report["decode_tokens_per_s"] > 0
    check_roofline(report["roofline"], tiny_model, batch=2, mean_context=4 + 3 / 2)


def test_a_batch_run_leaves_no_step_in_flight():
    """Requests that end on eos leave the step dispatched meanwhile in flight (overlap); run_batch
    processes it, so each run's step records are complete and none spills into the next run."""
    engine, _ = common.make_engine(load_config(TINY_CONFIG, precompile=False), progress=False)
    params = [SamplingParams(temperature=0, max_tokens=10)] * 2
    runs = [common.run_batch(engine, ["12+34=", "1+1="], params, progress=False) for _ in range(2)]
    assert [o.outputs[0].finish_reason for run in runs for o in run.outputs] == ["stop"] * 4
    for run in runs:
        assert run.steps and all(s.t_end > 0 for s in run.steps)
    assert max(s.step for s in runs[0].steps) < min(s.step for s in runs[1].steps)
    assert not engine.step_recorder._by_step  # no step waits to be processed


def test_bench_rejects_bad_flags(tmp_path, capsys):
    assert cli_main(["bench", "latency", "--config", str(TINY_CONFIG), "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err


def test_tight_loop_decode_smoke(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("tight_loop_decode", ROOT / "benchmarks" / "tight_loop_decode.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    out = tmp_path / "tight.json"
    assert module.main(["--config-json", str(FIXTURE / "config.json"), "--batch-sizes", "2", "--context", "4",
                        "--steps", "2", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"], r["steps"], r["executables"]) for r in rows] == [(2, 4, 2, 1), (2, 4, 2, 2)]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["ms_per_step"] / 1e3))
        assert r["roofline_share"] == pytest.approx(r["tokens_per_s"] / r["roofline_tokens_per_s"])
        assert r["ms_per_step"] > 0 and r["bytes_per_step"] > 0


def test_bench_multi_turn_brings_histories_back_from_the_host_tier(tmp_path):
    """3 turns of 4 conversations on a device pool smaller than their histories: the returning turns find
    their history as prefix hits, part of them from the host tier; every turn's tokens are counted."""
    report = bench(tmp_path, "multi-turn", "--config", str(TINY_CONFIG), "--num-conversations", "4", "--num-turns", "3",
                   "--first-len", "6", "--append-len", "2", "--output-len", "3", "--block-size", "4",
                   "--num-blocks", "12", "--host-kv-gib", "0.001", "--prefix-hash-seed", "1")
    turns = report["turns"]
    assert [t["prompt_len"] for t in turns] == [6, 11, 16]
    assert turns[0]["hit_rate"] == 0 and all(t["hit_rate"] > 0 for t in turns[1:])
    assert sum(t["host_hits"] for t in turns[1:]) > 0
    assert report["working_set_tokens"] == 4 * 16 and report["working_set_over_pool"] == pytest.approx(64 / 48)
    tokens = 4 * sum(length + 3 for length in (6, 11, 16))
    assert report["total_tokens_per_s"] == pytest.approx(tokens / report["elapsed_s"])
    check_summary(report["first_turn_ttft_ms"], 4)
    check_summary(report["returning_ttft_ms"], 8)
    assert cli_main(["bench", "multi-turn", "--config", str(TINY_CONFIG), "--num-turns", "0"]) == 2



def test_bench_multi_turn_closed_loop_keeps_at_most_n_turns_in_the_engine(tmp_path):
    """--max-concurrency 2: each conversation's next turn follows its own answer, never more than two turns in
    a step; every conversation still runs every turn with the same histories' lengths, and the returning turns
    find their history again through the host tier."""
    report = bench(tmp_path, "multi-turn", "--config", str(TINY_CONFIG), "--num-conversations", "4", "--num-turns", "3",
                   "--first-len", "6", "--append-len", "2", "--output-len", "3", "--block-size", "4",
                   "--num-blocks", "12", "--host-kv-gib", "0.001", "--prefix-hash-seed", "1", "--max-concurrency", "2")
    assert report["max_concurrency"] == 2
    turns = report["turns"]
    assert [t["prompt_len"] for t in turns] == [6, 11, 16]
    assert turns[0]["hit_rate"] == 0 and all(t["hit_rate"] > 0 for t in turns[1:])
    assert report["steps"]["steady_decode"]["batch"] <= 2 and report["steps"]["mean_decode_rows_per_step"] <= 2
    tokens = 4 * sum(length + 3 for length in (6, 11, 16))
    assert report["total_tokens_per_s"] == pytest.approx(tokens / report["elapsed_s"])
    assert report["engine"]["kv_cache"]["host_hits"] > 0
    check_summary(report["first_turn_ttft_ms"], 4)
    check_summary(report["returning_ttft_ms"], 8)
    assert cli_main(["bench", "multi-turn", "--config", str(TINY_CONFIG), "--max-concurrency", "0"]) == 2

def test_bench_fp8_flags_reach_the_engine_and_the_roofline(tmp_path, tiny_model):
    """--quantization fp8 and --kv-cache-dtype fp8 set model.quantization and cache.kv_cache_dtype; the roofline
    counts the FP8 weights' own bytes (less than the float32 ones) and 1 byte per KV element."""
    report = bench(tmp_path, "latency", "--config", str(TINY_CONFIG), "--batch-size", "2", "--input-len", "4",
                   "--output-len", "3", "--num-iters-warmup", "0", "--num-iters", "1", "--quantization", "fp8",
                   "--kv-cache-dtype", "fp8")
    config = report["engine"]["config"]
    assert config["model"]["quantization"] == "fp8" and config["cache"]["kv_cache_dtype"] == "fp8"
    cfg, roofline = tiny_model.config, report["roofline"]
    assert roofline["kv_bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    assert roofline["weight_bytes"] < sum(leaf.nbytes for leaf in jax.tree.leaves(tiny_model.params))
    assert report["decode_tokens_per_s"] > 0
