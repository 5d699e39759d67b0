"""Prefill/decode disaggregation end to end, as separate processes on loopback with the embedded model:
`jaxserve router` over one prefill and one decode instance (`jaxserve serve --pd-role ...`).

Greedy outputs through the router equal the decode instance's own colocated answers (it runs the same
engine), streaming and not, completions and chat, with the prompt's KV transferred (the decode instance
claims it). Faults: a decode instance that stops answering makes the transfer time out and the decode
instance re-prefill locally; a killed decode instance gives a clear 503. After each scenario both pools are
back at their starting free-block counts (/metrics).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import ROOT

TIMEOUT_S = 2.0  # server.kv_transfer_timeout_s of both instances
PROMPTS = ["1234+5678=", "99+1=", "505+250=", "31415+92653="]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_up(process: subprocess.Popen, url: str, what: str) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, f"{what} exited: " + process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"{what} did not start"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@contextlib.contextmanager
def _processes():
    started = []
    try:
        urls = {}
        for role in ("prefill", "decode"):
            port = _free_port()
            command = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--access-log", "false",
                       "--log-level", "warning", "--pd-role", role, "--kv-transfer-timeout-s", str(TIMEOUT_S)]
            started.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            urls[role] = f"http://127.0.0.1:{port}"
        for process, (role, url) in zip(started, urls.items()):
            _wait_up(process, url, role)
        port = _free_port()
        router = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "router", "--prefill", urls["prefill"],
                                   "--decode", urls["decode"], "--port", str(port), "--log-level", "warning"],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append(router)
        urls["router"] = f"http://127.0.0.1:{port}"
        _wait_up(router, urls["router"], "router")
        yield dict(zip(("prefill", "decode", "router"), started)), urls
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def pd():
    with _processes() as (processes, urls):
        start = {role: _free_blocks(urls[role]) for role in ("prefill", "decode")}
        yield processes, urls, start


def _free_blocks(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(float(re.search(r"^jaxserve:pd_free_blocks (\S+)$", text, re.M).group(1)))


def _info(url: str) -> dict:
    return httpx.get(url + "/pd/info").json()


def _assert_pools_return(urls: dict, start: dict, roles=("prefill", "decode")) -> None:
    deadline = time.monotonic() + 3 * TIMEOUT_S + 5
    while True:
        state = {role: (_free_blocks(urls[role]), _info(urls[role])["open_transfers"]) for role in roles}
        if all(state[role] == (start[role], 0) for role in roles):
            return
        assert time.monotonic() < deadline, f"blocks not returned: {state}, start {start}"
        time.sleep(0.2)


def _completion(url: str, prompt: str, stream: bool = False, **extra) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
    return text, finish


def test_outputs_equal_colocated_streaming_and_not(pd):
    _, urls, start = pd
    expected = [_completion(urls["decode"], p) for p in PROMPTS]  # the decode instance alone: colocated
    assert [_completion(urls["router"], p) for p in PROMPTS] == expected
    assert [_completion(urls["router"], p, stream=True) for p in PROMPTS] == expected
    prefill, decode = _info(urls["prefill"]), _info(urls["decode"])
    assert prefill["outcomes"].get("sent", 0) >= 2 * len(PROMPTS)
    assert decode["outcomes"].get("claimed", 0) >= 2 * len(PROMPTS)
    _assert_pools_return(urls, start)


def test_chat_through_the_router(pd):
    _, urls, start = pd
    body = {"messages": [{"role": "user", "content": "12+34="}], "max_tokens": 6, "temperature": 0}
    direct = httpx.post(urls["decode"] + "/v1/chat/completions", json=body, timeout=60).json()
    routed = httpx.post(urls["router"] + "/v1/chat/completions", json=body, timeout=60).json()
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    _assert_pools_return(urls, start)


def test_router_refuses_client_kv_transfer_params_and_instances_refuse_unsigned_ones(pd):
    _, urls, _ = pd
    bad = {"prompt": "1+1=", "kv_transfer_params": {"transfer_id": "ab" * 16, "decode_address": "10.0.0.1:1",
                                                    "signature": "00"}}
    assert httpx.post(urls["router"] + "/v1/completions", json=bad).status_code == 400
    response = httpx.post(urls["prefill"] + "/v1/completions", json=bad)
    assert response.status_code == 400 and "kv_transfer_token" in response.text


def test_transfer_timeout_makes_decode_re_prefill_locally(pd):
    processes, urls, start = pd
    expected = _completion(urls["decode"], PROMPTS[3])
    recomputed = _info(urls["decode"])["outcomes"].get("recomputed", 0)
    os.kill(processes["decode"].pid, signal.SIGSTOP)  # answers nothing: the prefill side's reserve times out
    try:
        with httpx.Client(timeout=60) as client:
            pending = client.build_request("POST", urls["router"] + "/v1/completions",
                                           json={"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0})
            result = {}
            thread = threading.Thread(target=lambda: result.update(r=client.send(pending)))
            thread.start()
            time.sleep(TIMEOUT_S + 1.0)
            os.kill(processes["decode"].pid, signal.SIGCONT)
            thread.join(60)
    finally:
        os.kill(processes["decode"].pid, signal.SIGCONT)
    response = result["r"]
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == expected
    assert _info(urls["prefill"])["outcomes"].get("timeout", 0) >= 1
    assert _info(urls["decode"])["outcomes"].get("recomputed", 0) == recomputed + 1
    _assert_pools_return(urls, start)


def test_killed_decode_instance_gives_a_clear_503_and_frees_the_prefill_side(pd):
    processes, urls, start = pd
    processes["decode"].send_signal(signal.SIGKILL)
    processes["decode"].wait()
    response = httpx.post(urls["router"] + "/v1/completions", json={"prompt": "1+2=", "max_tokens": 4}, timeout=60)
    assert response.status_code == 503 and "decode" in response.json()["error"]["message"]
    _assert_pools_return(urls, start, roles=("prefill",))
