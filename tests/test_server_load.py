"""The server under load, on loopback, serving the embedded model: 200 concurrent streaming clients with no
lost or duplicated token (against the same engine run offline) and no leaked KV block; a client that goes
away mid-stream frees its blocks; a full queue answers 429; per-sequence inter-token latency; per-tenant
fairness (a tenant that floods the queue does not hold back another's request); SIGTERM drains in-flight
requests, then exits 0, aborting what outlasts drain_timeout_s.

Servers here use one token bucket of 256 and one request bucket of 64, so every step costs about the same
whatever the batch (~10-20 ms on the CPU): a request lasts long enough to be caught mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from jaxserve.sampling_params import SamplingParams
from tests.conftest import ROOT
from tests.test_server import LiveServer, server_config

FLAT_STEPS = {"max_num_batched_tokens": 256, "token_buckets": [256], "request_buckets": [64]}
NUM_CLIENTS = 200


def load_requests() -> list[tuple[str, SamplingParams]]:
    rng = random.Random(0)
    requests = []
    for i in range(NUM_CLIENTS):
        prompt = f"{rng.randrange(1000)}+{rng.randrange(1000)}="
        # Half stop at eos; half run on past it (ignore_eos) for longer, still deterministic, streams.
        requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=6 + i % 8, ignore_eos=i % 2 == 1,
                                                logprobs=0)))
    return requests


def run_offline(engine, requests) -> list:
    """The same engine, driven directly (as LLM.generate does), before it is served."""
    prepared = [engine.prepare_request(prompt, params) for prompt, params in requests]
    for p in prepared:
        engine.enqueue(p)
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step(final_only=True):
            final[output.request_id] = output.outputs[0]
    return [final[p.request_id] for p in prepared]


@pytest.fixture(scope="module")
def load_server():
    from jaxserve.engine import Engine

    config = server_config(**FLAT_STEPS)
    engine = Engine(config, progress=False)
    reference = run_offline(engine, load_requests())
    server = LiveServer(config, engine)
    server.reference = reference
    server.free_blocks_at_start = engine.kv_cache.num_free_blocks
    assert server.free_blocks_at_start == engine.kv_cache.pool.num_blocks - 1
    yield server
    server.stop()


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(f"jaxserve:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- 200 concurrent streaming clients ---------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, index: int, prompt: str, params: SamplingParams) -> dict:
    common = {"max_tokens": params.max_tokens, "temperature": 0, "ignore_eos": params.ignore_eos, "stream": True,
              "stream_options": {"include_usage": True}}
    if index % 2 == 0:
        path, body = "/v1/completions", {"prompt": prompt, "logprobs": 0, **common}
    else:  # the chat template renders "<s>{content}=": the same tokens as the completion prompt
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt[:-1]}],
                                              "logprobs": True, "top_logprobs": 0, **common}
    text, tokens, finish, usage, done = "", [], None, None, False
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                assert finish is None, "a chunk after the finish reason"
                if "text" in choice:
                    text += choice["text"]
                    tokens += (choice["logprobs"] or {}).get("tokens", [])
                else:
                    text += choice["delta"].get("content") or ""
                    tokens += [entry["token"] for entry in (choice["logprobs"] or {}).get("content") or []]
                finish = choice["finish_reason"]
    assert done, "no [DONE]"
    return {"text": text, "tokens": tokens, "finish": finish, "usage": usage}


def test_200_concurrent_streams_lose_no_token_and_leak_no_block(load_server):
    requests = load_requests()

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=load_server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, i, prompt, params)
                                          for i, (prompt, params) in enumerate(requests)))

    start = time.monotonic()
    results = asyncio.run(asyncio.wait_for(run_all(), timeout=90))
    elapsed = time.monotonic() - start
    for i, (result, expected) in enumerate(zip(results, load_server.reference)):
        expected_tokens = [next(iter(entry.values())).decoded_token for entry in expected.logprobs]
        assert result["tokens"] == expected_tokens, (i, result, expected)
        assert result["text"] == expected.text and result["finish"] == expected.finish_reason, (i, result, expected)
        assert result["usage"]["completion_tokens"] == len(expected.token_ids), (i, result)
    load_server.wait_idle()
    assert load_server.engine.kv_cache.num_free_blocks == load_server.free_blocks_at_start
    print(f"{NUM_CLIENTS} streams in {elapsed:.1f} s")


# ---- disconnects ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_aborts_and_frees_blocks(load_server, stream):
    metrics = httpx.get(load_server.url + "/metrics").text
    aborted_before = metric(metrics, "request_success_total", finished_reason="abort")
    body = {"messages": [{"role": "user", "content": "12+34"}], "max_tokens": 25, "ignore_eos": True,
            "n": 4, "temperature": 1.0, "stream": stream}
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", load_server.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    if stream:
        received = b""
        while b"data: " not in received:  # the first event (the role) is out: the stream is open
            received += sock.recv(4096)
    deadline = time.monotonic() + 10
    while load_server.engine.kv_cache.num_free_blocks == load_server.free_blocks_at_start:
        assert time.monotonic() < deadline, "the request never got KV blocks"
        time.sleep(0.002)
    sock.close()  # mid-generation: 25 tokens take ~0.3 s here
    load_server.wait_idle()
    assert load_server.engine.kv_cache.num_free_blocks == load_server.free_blocks_at_start
    metrics = httpx.get(load_server.url + "/metrics").text
    assert metric(metrics, "request_success_total", finished_reason="abort") == aborted_before + 4
    assert metric(metrics, "num_requests_running") == 0 and metric(metrics, "kv_cache_usage_perc") == 0


# ---- metrics and tenants ----------------------------------------------------------------------------------------
def test_inter_token_latency_is_per_sequence(load_server):
    """n sequences step together: each one's inter-token latency is a step, not a step divided by n."""
    n, max_tokens = 4, 16
    names = ("inter_token_latency_seconds_count", "inter_token_latency_seconds_sum",
             "time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum")

    def histograms() -> dict[str, float]:
        text = httpx.get(load_server.url + "/metrics").text
        return {name: metric(text, name) for name in names}

    before = histograms()
    body = {"prompt": "12+34=", "n": n, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 0}
    response = httpx.post(load_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == n * max_tokens
    itl_count, itl_sum, ttft, e2e = (after - before[name] for name, after in histograms().items())
    assert itl_count == n * (max_tokens - 1)  # one gap between successive tokens of each sequence
    step = (e2e - ttft) / (max_tokens - 1)  # first token to last, over the gaps of one sequence
    assert itl_sum / itl_count == pytest.approx(step, rel=0.25)


def test_tenant_header_without_api_key(load_server, monkeypatch):
    """No API key configured: the tenant header names the tenant (checked), and no header means no tenant."""
    tenants = []
    enqueue = load_server.engine.enqueue
    monkeypatch.setattr(load_server.engine, "enqueue",
                        lambda prepared: tenants.append(prepared.tenant) or enqueue(prepared))
    body = {"prompt": "12+34=", "max_tokens": 4}
    for headers in ({"x-tenant-id": "team-a@example.com"}, {}):
        assert httpx.post(load_server.url + "/v1/completions", json=body, headers=headers).status_code == 200
    assert tenants == ["team-a@example.com", None]
    bad = httpx.post(load_server.url + "/v1/completions", json=body, headers={"x-tenant-id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tenant-id"


# ---- admission control ------------------------------------------------------------------------------------------
def test_full_queue_answers_429():
    server = LiveServer(server_config(max_queued_requests=2, max_num_seqs=1, retry_after_s=3, **FLAT_STEPS))
    body = {"prompt": "12+34=", "max_tokens": 20, "ignore_eos": True, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    try:
        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses  # the queue holds 2
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "3"
        error = refused.json()["error"]
        assert error["type"] == "RateLimitError" and "max_queued_requests=2" in error["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 20 for r in responses if r.status_code == 200)
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        server.wait_idle()
        assert server.engine.kv_cache.usage == 0.0
    finally:
        server.stop()


def test_engine_failure_fails_open_requests_and_health():
    server = LiveServer(server_config(**FLAT_STEPS))

    def broken_step(*args, **kwargs):
        raise RuntimeError("injected step failure")

    server.engine.step = broken_step
    body = {"prompt": "12+34=", "max_tokens": 4}
    try:
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "engine failed" in health.json()["error"]["message"]
        refused = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        server.stop()


# ---- server processes: fairness, then SIGTERM ---------------------------------------------------------------------
@contextlib.contextmanager
def serve_process(*flags: str) -> Iterator[subprocess.Popen]:
    """`jaxserve serve FLAGS` on a free loopback port, once /health answers (its URL in `.url`); killed at
    the end if still running."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--access-log", "false",
               "--log-level", "warning", *flags]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the server process did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        process.url = url
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server_process():
    with serve_process("--policy", "fair", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
                       "--token-buckets", "[256]", "--request-buckets", "[64]",
                       "--max-queued-requests", "100000") as process:
        yield process


def test_fairness_a_flooding_tenant_does_not_hold_back_the_other(server_process):
    """Needs scheduler.policy "fair" wired to core.fairness.FairWaitingQueue (test_fairness.py checks it).
    Tenant A queues 32 requests; B sends one once most of them wait. Fair sharing starts B at the next free
    slot (of 4), so B finishes before most of A's requests; FCFS would finish all of A's first. The order
    of completions is asserted, not a speed: every request completes, with the same greedy text."""
    body = {"prompt": "12+7=", "max_tokens": 20, "ignore_eos": True, "temperature": 0}

    async def scenario():
        finished = []
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server_process.url, timeout=120, limits=limits) as client:
            async def one(tenant):
                response = await client.post("/v1/completions", json=body, headers={"x-tenant-id": tenant})
                assert response.status_code == 200, response.text
                finished.append((tenant, response.json()["choices"][0]))

            flood = [asyncio.create_task(one("a")) for _ in range(32)]
            while metric((await client.get("/metrics")).text, "num_requests_waiting") < 20:
                await asyncio.sleep(0.01)
            await asyncio.gather(*flood, one("b"))
        return finished

    finished = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    tenants = [tenant for tenant, _ in finished]
    assert sorted(tenants) == ["a"] * 32 + ["b"]
    assert len({choice["text"] for _, choice in finished}) == 1
    assert all(choice["finish_reason"] == "length" for _, choice in finished)
    assert tenants.index("b") <= 12, f"B finished after {tenants.index('b')} of A's 32 requests: {tenants}"


def test_sigterm_drains_in_flight_requests_then_exits_0(server_process):
    url = server_process.url
    body = {"prompt": "12+34=", "max_tokens": 20, "ignore_eos": True, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            prompt_tokens = metric((await client.get("/metrics")).text, "prompt_tokens_total")
            in_flight = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(32)]
            # Every request reached the engine (7 prompt tokens each): none is still being tokenized, so
            # not yet admitted, when the drain starts.
            while metric((await client.get("/metrics")).text, "prompt_tokens_total") < prompt_tokens + 32 * 7:
                await asyncio.sleep(0.01)
            server_process.send_signal(signal.SIGTERM)
            while (await client.get("/health")).status_code == 200:
                await asyncio.sleep(0.005)
            health = await client.get("/health")
            late = await client.post("/v1/completions", json=body)
            still_running = sum(not task.done() for task in in_flight)
            return await asyncio.gather(*in_flight), health, late, still_running

    responses, health, late, still_running = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert late.json()["error"]["type"] == "ServiceUnavailableError"
    assert still_running > 0, "the drain should have had requests left to finish"
    assert [r.status_code for r in responses] == [200] * 32
    assert all(r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 20
               for r in responses)
    assert server_process.wait(timeout=30) == 0


def test_sigterm_aborts_what_outlasts_the_drain_timeout_then_exits_0():
    """Streams still running when drain_timeout_s ends are aborted (finish_reason "abort", then [DONE]) and the
    process exits 0 right after, however much work they had left."""
    drain_timeout_s = 0.5
    # One sequence at a time: 32 streams of 25 tokens are 800 steps, far more than the drain timeout allows.
    with serve_process("--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--token-buckets", "[16]",
                       "--request-buckets", "[4]", "--drain-timeout-s", str(drain_timeout_s)) as process:
        params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)

        async def scenario():
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=process.url, timeout=60, limits=limits) as client:
                streams = [asyncio.create_task(stream_one(client, 2 * i, "12+34=", params))  # even: completions
                           for i in range(32)]
                while metric((await client.get("/metrics")).text, "prompt_tokens_total") < 32 * 7:  # all admitted
                    await asyncio.sleep(0.01)
                process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                return await asyncio.gather(*streams), signalled

        results, signalled = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert process.wait(timeout=drain_timeout_s + 10) == 0
        exited = time.monotonic() - signalled
    finishes = [result["finish"] for result in results]
    assert set(finishes) <= {"length", "abort"} and finishes.count("abort") >= 8, finishes  # ended, with [DONE]
    assert all(len(r["tokens"]) == r["usage"]["completion_tokens"] for r in results)  # nothing lost on the way
    assert all(len(r["tokens"]) == 25 for r in results if r["finish"] == "length")
    assert exited < drain_timeout_s + 5, f"exited {exited:.1f} s after SIGTERM"
