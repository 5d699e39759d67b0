"""`jaxserve serve` with parallel.data: 2 (two T=1 replicas on fake CPU devices), next to the single-engine
server: the same greedy text, streaming and not; requests spread over both replicas; metrics summed over
them; a client that disconnects has its request aborted on the replica holding it; no KV block left held."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.config import ParallelConfig
from jaxserve.data_parallel import DataParallelEngine
from tests.test_server import LiveServer, server_config
from tests.test_server_load import metric

PROMPTS = ["12+34=", "505+250=", "999+1=", "7+8=", "1+1="]
SMALL = {"token_buckets": [16], "request_buckets": [4], "max_num_batched_tokens": 16, "max_num_seqs": 4,
         "precompile": False, "compilation_cache_dir": None}


def dp_config(data: int):
    return dataclasses.replace(server_config(**SMALL), parallel=ParallelConfig(data=data))


@pytest.fixture(scope="module")
def single():
    server = LiveServer(dp_config(1))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dp():
    config = dp_config(2)
    server = LiveServer(config, DataParallelEngine(config, progress=False))
    yield server
    server.stop()


def completions(server: LiveServer) -> list[str]:
    """All prompts in one request (enqueued together), greedy."""
    response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 8, "temperature": 0},
                          timeout=60)
    assert response.status_code == 200, response.text
    return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def stream(server: LiveServer, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])


def assert_no_block_held(server: LiveServer) -> None:
    server.wait_idle()
    for replica in getattr(server.engine, "engines", [server.engine]):
        assert replica.kv_cache.num_free_blocks == replica.kv_cache.pool.num_blocks - 1


def test_same_greedy_text_as_one_engine_spread_over_both_replicas(single, dp):
    expected = completions(single)
    assert expected[0] == "46"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        expected_streams = list(pool.map(lambda p: stream(single, p), PROMPTS))
        assert completions(dp) == expected
        assert list(pool.map(lambda p: stream(dp, p), PROMPTS)) == expected_streams == expected
    replicas = dp.engine.engines
    assert all(replica.kv_cache.stats.queries > 0 for replica in replicas), "a replica served nothing"
    assert_no_block_held(single)
    assert_no_block_held(dp)
    assert dp.engine.distributor.loads == [0, 0]
    text = httpx.get(dp.url + "/metrics").text
    assert metric(text, "prefix_cache_queries_total") == sum(r.kv_cache.stats.queries for r in replicas)
    assert metric(text, "num_requests_running") == 0 and metric(text, "kv_cache_usage_perc") == 0
    assert httpx.get(dp.url + "/health").status_code == 200


def test_disconnect_aborts_on_the_owning_replica(dp, monkeypatch):
    for replica in dp.engine.engines:  # ~20 ms a step: the request is still running when the client goes
        monkeypatch.setattr(replica, "step", lambda step=replica.step, **kw: time.sleep(0.02) or step(**kw))
    aborted_before = metric(httpx.get(dp.url + "/metrics").text, "request_success_total", finished_reason="abort")
    payload = json.dumps({"prompt": "12+34=", "max_tokens": 20, "ignore_eos": True, "n": 2, "temperature": 1.0,
                          "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        received = b""
        while b"data: " not in received:  # tokens are streaming
            received += sock.recv(4096)
    assert_no_block_held(dp)
    text = httpx.get(dp.url + "/metrics").text
    assert metric(text, "request_success_total", finished_reason="abort") == aborted_before + 2
    assert dp.engine.distributor.loads == [0, 0]
