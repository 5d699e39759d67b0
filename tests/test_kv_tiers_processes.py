"""Engine processes sharing a KV disk directory: blocks written by one process (flushed from its device and
host tiers when it closes) are prefix hits in another, with the same prefix_hash_seed and model; and an
engine's close() leaves every block it cached on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from tests.conftest import ROOT

pytestmark = pytest.mark.cpu_test

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
BLOCK_GIB = 8192 / (1 << 30)  # one block of the embedded model
PROMPTS = ["12345+678=", "4321+87654=", "31415+9265="]


def generate(tmp_path, name: str, disk: str, seed: int) -> list[dict]:
    """`jaxserve generate` in a process of its own, greedy, the results as JSON lines."""
    out = tmp_path / f"{name}.jsonl"
    argv = [sys.executable, "-m", "jaxserve.cli", "generate", "--config", str(TINY_CONFIG), "--quiet",
            "--temperature", "0", "--max-tokens", "6", "--output", str(out), "--precompile", "false",
            "--num-blocks", "64", "--host-kv-gib", str(16 * BLOCK_GIB), "--disk-kv-path", disk,
            "--disk-kv-gib", "0.01", "--prefix-hash-seed", str(seed)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_second_process_hits_the_blocks_the_first_wrote(tmp_path):
    disk = str(tmp_path / "kv")
    first = generate(tmp_path, "first", disk, seed=9)
    assert all(result["num_cached_tokens"] == 0 for result in first)
    assert list((tmp_path / "kv").rglob("*.kv")), "the first process left no block on disk"
    second = generate(tmp_path, "second", disk, seed=9)
    # every full block of each prompt but the one holding its last token comes from the first process's files
    assert all(result["num_cached_tokens"] >= 8 for result in second)
    assert [r["outputs"][0]["token_ids"] for r in second] == [r["outputs"][0]["token_ids"] for r in first]
    other_seed = generate(tmp_path, "other", disk, seed=10)  # other keys: nothing to share
    assert all(result["num_cached_tokens"] == 0 for result in other_seed)


def test_close_writes_the_device_and_host_blocks_to_disk(tmp_path):
    options = dict(num_blocks=64, host_kv_gib=2 * BLOCK_GIB, disk_kv_path=str(tmp_path / "kv"), disk_kv_gib=0.01,
                   prefix_hash_seed=4, precompile=False)
    llm = LLM(config=load_config(TINY_CONFIG), progress=False, **options)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    llm.generate(PROMPTS, greedy, use_tqdm=False)
    cached = set(llm.engine.kv_cache.pool.cached_blocks)  # on the device only: nothing was evicted
    assert cached and not list((tmp_path / "kv").rglob("*.kv"))
    llm.close()
    llm.close()  # (idempotent)
    names = {path.stem for path in (tmp_path / "kv").rglob("*.kv")}
    assert {key.hex() for key in cached} <= names
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, greedy, use_tqdm=False)
    restarted = LLM(config=load_config(TINY_CONFIG), progress=False, **options)
    again = restarted.generate(PROMPTS, greedy, use_tqdm=False)
    assert all(out.num_cached_tokens >= 8 for out in again)
    assert restarted.engine.kv_cache.stats.disk_hits > 0
    restarted.close()
