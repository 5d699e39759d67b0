"""The bench's synthetic speculative acceptance (bench only, outputs not meaningful): accepted lengths follow
the truncated geometric law on device and in the engine, nothing compiles when it changes, it is refused
outside the bench; the spec-decode counters in the bench's JSON and in /metrics; and the Python part of
benchmarks/devrun_spec.sh (bench reports -> the summary table) on the embedded model."""

from __future__ import annotations

import argparse
import json
import math

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.bench import common, spec
from jaxserve.cli import main as cli_main
from jaxserve.config import SpeculativeConfig, load_config
from jaxserve.config_flags import config_flags
from jaxserve.core import spec_schedule
from jaxserve.engine_client import EngineStats
from jaxserve.runner import spec_verify
from jaxserve.server.metrics import ServerMetrics
from tests.conftest import ROOT

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K}


def expected_accepted(acceptance: float, num_guesses: int) -> float:
    """E[accepted] of a draft of n guesses, each accepted with probability A while the earlier ones were."""
    return sum(acceptance ** j for j in range(1, num_guesses + 1))


def accepted_variance(acceptance: float, num_guesses: int) -> float:
    probs = [acceptance ** j * (1 - acceptance if j < num_guesses else 1) for j in range(num_guesses + 1)]
    mean = sum(j * p for j, p in enumerate(probs))
    return sum((j - mean) ** 2 * p for j, p in enumerate(probs))


def test_synthetic_verify_accepts_a_geometric_prefix():
    requests = 2048
    rows = requests * (K + 1)
    rng = np.random.default_rng(0)
    first = np.arange(requests) * (K + 1)
    checks = np.full(rows, -1, np.int32)
    for j in range(K):
        checks[first + j] = rng.integers(0, 50, requests)
    seeds = np.repeat(rng.integers(0, 2**32, (requests, 2), dtype=np.uint32), K + 1, axis=0)
    steps = (np.repeat(rng.integers(0, 1000, requests), K + 1) + np.tile(np.arange(K + 1), requests)).astype(np.int32)
    tokens = jax.numpy.arange(rows, dtype=jax.numpy.int32) + 1000  # each row's "sampled" token names the row
    padded_first = np.zeros(rows, np.int32)
    padded_first[:requests] = first

    def run(acceptance: float):
        out, accepted = spec_verify.verify_synthetic(tokens, checks, padded_first, seeds, steps,
                                                     np.asarray(acceptance, np.float32))
        return np.asarray(out)[:requests], np.asarray(accepted)[:requests]

    run(0.5)
    with jax.no_tracing():  # the acceptance is an input: every value runs the one executable
        for acceptance in (0.0, 0.3, 0.8, 1.0):
            out, accepted = run(acceptance)
            assert ((0 <= accepted) & (accepted <= K)).all()
            np.testing.assert_array_equal(out, first + accepted + 1000)  # the token at the first rejected row
            sd = math.sqrt(accepted_variance(acceptance, K) / requests)
            assert abs(accepted.mean() - expected_accepted(acceptance, K)) <= 4 * sd + 1e-9
            assert abs((accepted >= 1).mean() - acceptance) <= 4 * math.sqrt(acceptance * (1 - acceptance) / requests)


@pytest.fixture(scope="module")
def engine():
    # One request bucket (64 logits rows: 16 requests and their guesses) and the token buckets the batch
    # runs, each precompiled (fewer programs to compile than the default ladder's).
    config = load_config(TINY_CONFIG, speculative_config=SPEC, token_buckets=[64, 256], request_buckets=[64])
    config = spec.apply(config, argparse.Namespace(spec_synthetic_acceptance=[0.5]))
    engine, _ = common.make_engine(config, progress=False)  # (every bucket precompiled)
    return engine


def test_engine_accepted_lengths_and_no_compiles_across_acceptances(engine, monkeypatch):
    drafts = []
    accept = spec_schedule.accept

    def spy(request, guesses, token, accepted, scheduled=None):
        drafts.append((len(guesses), accepted))
        return accept(request, guesses, token, accepted, scheduled)

    monkeypatch.setattr(spec_schedule, "accept", spy)
    # 16 rows at a time: each guess takes a logits row that no running request holds (64 in all).
    prompts = [{"prompt": f"{a}+{b}="} for a, b in np.random.default_rng(1).integers(0, 100, (16, 2))]
    params = [SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)] * len(prompts)
    common.run_batch(engine, prompts, params, progress=False)  # warm-up at 0.5
    with jax.no_tracing():
        for acceptance in (0.2, 0.8):
            drafts.clear()
            spec.set_acceptance(engine, acceptance)
            for _ in range(3):
                common.run_batch(engine, prompts, params, progress=False)
            guesses = np.array([n for n, _ in drafts])
            accepted = np.array([a for _, a in drafts])
            # Every row guesses k tokens (the n-gram's padded), fewer only where the token limit is near; under
            # overlap a row takes a plain token right behind each verify step.
            assert len(drafts) > 200 and (guesses == K).mean() > 0.7  # enough drafts for the sum test
            expected = sum(expected_accepted(acceptance, n) for n in guesses)
            sd = math.sqrt(sum(accepted_variance(acceptance, n) for n in guesses))
            assert abs(accepted.sum() - expected) <= 4 * sd


def test_refused_outside_the_bench(engine):
    config = engine.config
    assert config.speculative.synthetic_acceptance == 0.5
    with pytest.raises(ValueError, match="bench-only.*--spec-synthetic-acceptance"):
        LLM(config=config, progress=False)
    with pytest.raises(ValueError, match="bench-only"):
        LLM(config=load_config(TINY_CONFIG), progress=False, speculative_config={**SPEC, "synthetic_acceptance": 0.5})
    assert not [f for f in config_flags() if "synthetic" in f.flag]  # no serve / generate flag
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=K, synthetic_acceptance=1.5)
    with pytest.raises(ValueError, match="needs a speculative method"):
        SpeculativeConfig(synthetic_acceptance=0.5)
    assert cli_main(["bench", "latency", "--spec-synthetic-acceptance", "0.5", "--num-iters", "1"]) == 2  # no method


def test_metrics_export_the_spec_decode_counters():
    metrics = ServerMetrics("m")
    metrics.record_step(EngineStats(spec_draft_tokens=9, spec_accepted_tokens=4, spec_drafts=3,
                                    spec_accepted_per_position=(3, 1, 0)))
    metrics.record_step(EngineStats(spec_draft_tokens=12, spec_accepted_tokens=5, spec_drafts=4,
                                    spec_accepted_per_position=(4, 1, 0)))
    text = metrics.render().decode()
    for line in ('jaxserve:spec_decode_num_drafts_total{model_name="m"} 4.0',
                 'jaxserve:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'jaxserve:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0',
                 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 0.0'):
        assert line in text


def test_bench_reports_and_the_devrun_summary(tmp_path):
    """devrun_spec.sh's Python part: a plain and a synthetic sweep report at batch 1, then the table."""
    work = tmp_path / "work"
    shape = ["--config", str(TINY_CONFIG), "--batch-size", "2", "--input-len", "4", "--output-len", "12",
             "--num-iters-warmup", "0", "--num-iters", "1", "--disable-tqdm", "--precompile", "false"]
    for name, extra in (("plain_b1", []), ("spec_b1", ["--speculative-config", json.dumps(SPEC),
                                                       "--spec-synthetic-acceptance", "0,0.8,1"])):
        assert cli_main(["bench", "latency", *shape, *extra, "--output-json", str(work / f"{name}.json")]) == 0
    report = json.loads((work / "spec_b1.json").read_text())
    section = report["spec_decode"]
    assert section["synthetic_acceptance"] == 0.0 and "outputs not meaningful" in section["note"]
    assert section["num_drafts"] > 0 and section["num_accepted_tokens"] == 0
    assert section["mean_accepted_length"] == 1.0 and section["per_position_acceptance"] == [0.0] * K
    sweep = report["synthetic_sweep"]
    assert [entry["spec_decode"]["synthetic_acceptance"] for entry in sweep] == [0.0, 0.8, 1.0]
    full = sweep[2]["spec_decode"]  # acceptance 1: every guess accepted
    assert full["acceptance_rate"] == 1.0 and full["per_position_acceptance"][0] == 1.0
    assert full["num_draft_tokens"] == full["num_accepted_tokens"] > 0
    assert "spec_decode" not in json.loads((work / "plain_b1.json").read_text())

    import benchmarks.spec_summary as summary

    table = summary.summarise(work)
    points = {p["acceptance"]: p for p in table[1]["spec"]["points"]}
    assert points[0.0]["tokens_per_step"] == 1.0 and points[0.0]["step_ratio"] > 0
    assert table[1]["plain"]["host_ms"] > 0 and all(p["host_ms"] > 0 for p in points.values())
    assert points[1.0]["speedup"] > 0
    text = summary.render(table)
    assert "(a) verify step at batch 1" in text and "SYNTHETIC" in text and "n/a" not in text.splitlines()[2]
    # a draft run's report (here the n-gram one under the FP8 draft's name) has its own rows and (c) figure
    (work / "draft_fp8_b1.json").write_text((work / "spec_b1.json").read_text())
    text = summary.render(summary.summarise(work))
    assert "draft-fp8" in text and "its FP8 draft: n/a" not in text


def test_bench_throughput_reports_real_acceptance(tmp_path):
    out = tmp_path / "t.json"
    assert cli_main(["bench", "throughput", "--config", str(TINY_CONFIG), "--num-prompts", "4", "--input-len", "6",
                     "--output-len", "8", "--disable-tqdm", "--precompile", "false", "--speculative-config",
                     json.dumps({**SPEC, "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
                     "--output-json", str(out)]) == 0
    section = json.loads(out.read_text())["spec_decode"]
    assert section["synthetic_acceptance"] is None and "note" not in section
    assert section["num_drafts"] > 0 and section["num_draft_tokens"] >= section["num_drafts"]
    assert 0.0 <= section["acceptance_rate"] <= 1.0
    assert len(section["per_position_acceptance"]) <= K
