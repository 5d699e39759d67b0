"""The KV cache tiers in /metrics and in `jaxserve bench`: per-tier hits, misses, bytes, evictions, loads
and their seconds, usage per tier and swap preemptions, read back from a live server on the embedded model
whose small device pool pushes blocks to the host and disk tiers."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from jaxserve.bench import common
from jaxserve.cli import main as cli_main
from tests.test_server import LiveServer, server_config

pytestmark = pytest.mark.cpu_test

BLOCK_GIB = 8192 / (1 << 30)  # one block of the embedded model
# Distinct openings of 2-3 blocks, each sent twice with other prompts between: the second finds its
# prefix on host or disk.
PROMPTS = [f"{a}+{b}=" for a, b in [(12345, 678), (4321, 87654), (99, 12), (5555, 4444), (31415, 9265)]]


def series(text: str) -> dict[tuple[str, str], float]:
    """(metric name, its labels other than model_name) -> value, for the kv tier series."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^(jaxserve:kv_[a-z_]+)\{(.*)\} (\S+)$", line)
        if match:
            name, labels, value = match.groups()
            label = [v for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if k != "model_name"]
            found[(name, label[0] if label else "")] = float(value)
    return found


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    config = server_config(num_blocks=10, host_kv_gib=8 * BLOCK_GIB, disk_kv_path=str(tmp_path_factory.mktemp("kv")),
                           disk_kv_gib=0.01, prefix_hash_seed=3, preemption_mode="swap", max_num_seqs=8)
    server = LiveServer(config)
    yield server
    server.stop()


def test_tier_metrics_are_exported(live):
    before = series(httpx.get(live.url + "/metrics").text)
    assert not any(value for value in before.values())  # nothing moved yet
    for _ in range(2):
        for prompt in PROMPTS:  # one at a time: each evicts the last one's blocks
            answer = httpx.post(live.url + "/v1/completions", json={"model": "tiny-adder", "prompt": prompt,
                                                                    "max_tokens": 4, "temperature": 0}, timeout=60)
            assert answer.status_code == 200
    # several at once on 9 blocks: preemption, by swap (the host has room for a preempted request's blocks)
    body = {"model": "tiny-adder", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 200
    live.wait_idle()
    live.engine.kv_transfer.poll(live.engine.kv_cache.tier_link, wait=True)  # the disk writes landed
    httpx.post(live.url + "/v1/completions", json={"model": "tiny-adder", "prompt": "1+1=", "max_tokens": 1},
               timeout=60)  # (one more step: the metrics are taken after a step)
    live.wait_idle()
    text = httpx.get(live.url + "/metrics").text
    got = series(text)
    kv = live.engine.stats().kv_cache
    assert got[("jaxserve:kv_tier_hits_total", "host")] == kv.host_hits > 0
    assert got[("jaxserve:kv_tier_bytes_in_total", "host")] == kv.host_bytes_in > 0
    assert got[("jaxserve:kv_tier_bytes_out_total", "host")] == kv.host_bytes_out > 0
    assert got[("jaxserve:kv_tier_evictions_total", "host")] == kv.host_evictions > 0
    assert got[("jaxserve:kv_tier_evictions_total", "device")] == kv.evictions > 0
    assert got[("jaxserve:kv_tier_bytes_in_total", "disk")] == kv.disk_bytes_in > 0
    assert got[("jaxserve:kv_tier_misses_total", "disk")] == kv.disk_misses
    assert got[("jaxserve:kv_tier_loads_total", "host")] == kv.host_loads > 0
    assert got[("jaxserve:kv_tier_load_seconds_total", "host")] == pytest.approx(kv.host_load_seconds)
    assert kv.host_load_seconds > 0
    assert got[("jaxserve:kv_swaps_total", "out")] == kv.swaps_out > 0
    assert got[("jaxserve:kv_swaps_total", "in")] == kv.swaps_in == kv.swaps_out
    for tier in ("device", "host", "disk"):
        assert 0.0 <= got[("jaxserve:kv_tier_usage_perc", tier)] <= 1.0
    assert got[("jaxserve:kv_tier_usage_perc", "host")] > 0
    assert 'jaxserve:kv_cache_usage_perc{model_name="tiny-adder"}' in text  # vLLM's series stays as it is


def test_bench_reports_the_tiers(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["bench", "throughput", "--config", str(common.DEFAULT_CONFIG), "--num-prompts", "12", "--input-len", "9",
            "--output-len", "6", "--num-blocks", "12", "--host-kv-gib", str(64 * BLOCK_GIB),
            "--preemption-mode", "swap", "--precompile", "false", "--disable-tqdm", "--output-json", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "KV cache: prefix hits" in printed and "host: hits" in printed and "swaps out/in" in printed
    engine = json.loads(out.read_text())["engine"]
    kv = engine["kv_cache"]
    assert kv["swaps_out"] > 0 and kv["swaps_in"] == kv["swaps_out"] and kv["host_bytes_in"] > 0
    assert engine["num_preemptions"] >= kv["swaps_out"]  # every swap-out is a preemption
    assert set(kv["usage"]) == {"device", "host"}
