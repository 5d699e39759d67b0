"""Prefill/decode disaggregation end to end, as separate processes on loopback with the embedded model:
`jaxserve router` over two prefill and two decode instances (`jaxserve serve --pd-role ...`), started once
for the module; the tests that kill instances run last. prefill0 moves KV through the host (bytes on the
control connection), prefill1 device to device (jax.experimental.transfer); decode1 speculates (n-gram
guesses), so PD composes with speculation in every scenario that lands there.

Greedy outputs through the router equal a decode instance's own colocated answers (it runs the same
engine), streaming and not, completions and chat, one by one and as 200 concurrent streams. Faults: dropped,
delayed, duplicated and truncated control messages (a proxy between the prefill and the decode instance,
the test playing the router), a decode pool full of reservations (the router goes elsewhere, then waits),
a decode instance that stops answering, a prefill instance killed mid-transfer, every prefill instance
gone, decode instances killed. Every request completes or fails with a clear error, and after each
scenario the pools of the instances still up are back at their starting free-block counts (/metrics) with
no transfer open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import httpx
import pytest

from jaxserve.pd import protocol as proto
from tests.conftest import ROOT
from tests.pd_fault_proxy import FaultProxy, free_port

TIMEOUT_S = 2.0  # server.kv_transfer_timeout_s of the instances
PROMPTS = ["1234+5678=", "99+1=", "505+250=", "31415+92653="]
LONG = "1234567+7654321+11111+222="  # 27 tokens with BOS: 6 transferable blocks of 4


def _fresh(i: int) -> str:
    """A prompt like LONG that no instance has seen (so its blocks really move)."""
    return f"{i:07d}+7654321+11111+222="
KEY = proto.derive_key(None)  # the instances run without server.kv_transfer_token (loopback only)
INSTANCES = ("prefill0", "prefill1", "decode0", "decode1")
# The server processes: unbuffered, and with Python's fault handler, which writes every thread's stack to
# stderr on SIGABRT (the module's teardown sends it when a test failed, to show where a process hung).
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def _log_tail(process: subprocess.Popen, size: int = 3000) -> str:
    """The end of a process's stderr (a file: `_processes`)."""
    with open(process.log_path, "rb") as log:
        return log.read().decode(errors="replace")[-size:]


def _wait_up(process: subprocess.Popen, url: str, what: str) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, f"{what} exited: " + _log_tail(process)
        assert time.monotonic() < deadline, f"{what} did not start"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def _popen(command: list[str], log_path, env=None) -> subprocess.Popen:
    """A server process whose stderr goes to a file: a pipe nobody reads while the tests run would fill
    up and block the process the first time it logs much (errors under a slow machine, say)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=env)
    process.log_path = log_path
    return process


@contextlib.contextmanager
def _processes(log_dir):
    started, urls = {}, {}
    try:
        for name in INSTANCES:
            port = free_port()
            command = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--access-log", "false",
                       "--log-level", "error", "--pd-role", name[:-1], "--kv-transfer-timeout-s", str(TIMEOUT_S),
                       "--precompile", "false"]  # (shapes compile as the tests first use them)
            if name == "prefill0":  # prefill1 sends device to device (the default), prefill0 through the host
                command += ["--kv-transfer-method", "host"]
            if name == "decode1":  # PD with speculation: n-gram guesses over the transferred prompts
                command += ["--speculative-method", "ngram", "--num-speculative-tokens", "2",
                            "--prompt-lookup-min", "1"]
            started[name] = _popen(command, log_dir / f"{name}.log", env=ENV)
            urls[name] = f"http://127.0.0.1:{port}"
        for name in INSTANCES:
            _wait_up(started[name], urls[name], name)
        port = free_port()
        command = [sys.executable, "-m", "jaxserve.cli", "router", "--port", str(port), "--log-level", "error"]
        for name in INSTANCES:
            command += [f"--{name[:-1]}", urls[name]]
        started["router"] = _popen(command, log_dir / "router.log", env=ENV)
        urls["router"] = f"http://127.0.0.1:{port}"
        _wait_up(started["router"], urls["router"], "router")
        yield started, urls
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def pd(request, tmp_path_factory):
    failed = request.session.testsfailed
    with _processes(tmp_path_factory.mktemp("pd-logs")) as (processes, urls):
        start = {name: _free_blocks(urls[name]) for name in INSTANCES}
        expected = {p: _completion(urls["decode0"], p) for p in PROMPTS + [LONG]}  # colocated answers
        yield processes, urls, start, expected
        if request.session.testsfailed > failed:  # the processes' own account, in the run's warnings summary
            for process in processes.values():  # every thread's stack into its log (PYTHONFAULTHANDLER)
                if process.poll() is None:
                    _signal_instance(process, signal.SIGABRT)
            for process in processes.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            tails = "".join(f"\n--- {name} stderr, its last 16000 characters ---\n{_log_tail(process, 16000)}"
                            for name, process in processes.items())
            warnings.warn("a PD test failed; the server processes' logs:" + tails, stacklevel=1)


def _signal_instance(process: subprocess.Popen, sig: int) -> None:
    """`sig` to an instance: its server process and that one's children (the engine process, which runs the
    KV transfer endpoints, and the tokenizer workers)."""
    tasks = f"/proc/{process.pid}/task"
    children = [int(pid) for task in os.listdir(tasks) for pid in open(f"{tasks}/{task}/children").read().split()]
    for pid in [*children, process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _free_blocks(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(float(re.search(r"^jaxserve:pd_free_blocks (\S+)$", text, re.M).group(1)))


def _info(url: str) -> dict:
    return httpx.get(url + "/pd/info").json()


def _outcome(url: str, what: str) -> int:
    return _info(url)["outcomes"].get(what, 0)


def _assert_pools_return(urls: dict, start: dict, names=INSTANCES) -> None:
    deadline = time.monotonic() + 3 * TIMEOUT_S + 5
    while True:
        state = {name: (_free_blocks(urls[name]), _info(urls[name])["open_transfers"]) for name in names}
        if all(state[name] == (start[name], 0) for name in names):
            return
        assert time.monotonic() < deadline, f"blocks not returned: {state}, start {start}"
        time.sleep(0.2)


def _completion(url: str, prompt: str, stream: bool = False, **extra) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
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
    _, urls, start, expected = pd
    sent = _outcome(urls["prefill0"], "sent") + _outcome(urls["prefill1"], "sent")
    assert [_completion(urls["router"], p) for p in PROMPTS] == [expected[p] for p in PROMPTS]
    assert [_completion(urls["router"], p, stream=True) for p in PROMPTS] == [expected[p] for p in PROMPTS]
    assert _outcome(urls["prefill0"], "sent") + _outcome(urls["prefill1"], "sent") == sent + 2 * len(PROMPTS)
    assert _outcome(urls["decode0"], "claimed") + _outcome(urls["decode1"], "claimed") >= 2 * len(PROMPTS)
    _completion(urls["router"], _fresh(200))  # blocks no decode instance has: written into its cache
    steps = [_info(urls[name])["steps"] for name in ("decode0", "decode1")]
    assert sum(s.get("install_steps", 0) for s in steps) >= 1 and sum(s["count"] for s in steps) >= 2 * len(PROMPTS)
    for split in (s["split_ms"]["all"] for s in steps if s["count"]):  # the engine thread ran and waited
        assert split["cpu"] > 0 and split["device_wait"] >= 0 and split["other"] >= 0
    assert "steps" not in _info(urls["prefill0"])
    _assert_pools_return(urls, start)


def test_chat_through_the_router(pd):
    _, urls, start, _ = pd
    body = {"messages": [{"role": "user", "content": "12+34="}], "max_tokens": 6, "temperature": 0}
    direct = httpx.post(urls["decode0"] + "/v1/chat/completions", json=body, timeout=60).json()
    routed = httpx.post(urls["router"] + "/v1/chat/completions", json=body, timeout=60).json()
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    _assert_pools_return(urls, start)


def _router_events(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics").text
    events = re.findall(r'^jaxserve:router_events\{event="(\w+)"\} (\S+)$', text, re.M)
    return {event: int(float(n)) for event, n in events}


@pytest.mark.parametrize("decode", ["decode0", "decode1"])
def test_a_local_prefill_router_prefills_short_prompts_on_the_decode_instance(pd, tmp_path, decode):
    """`jaxserve router --local-prefill-max-tokens 8`: prompts of at most 8 tokens (as the decode instance
    counts them) go to it without a transfer, longer ones through prefill1; the answers are the colocated
    ones, also on decode1, which speculates."""
    _, urls, start, expected = pd
    counts = {p: httpx.post(urls[decode] + "/tokenize", json={"prompt": p}).json()["count"] for p in PROMPTS + [LONG]}
    short = [p for p in PROMPTS + [LONG] if counts[p] <= 8]
    assert short and LONG not in short  # the rule sends some of them each way
    port = free_port()
    router = _popen([sys.executable, "-m", "jaxserve.cli", "router", "--port", str(port), "--log-level", "error",
                     "--local-prefill-max-tokens", "8", "--prefill", urls["prefill1"], "--decode", urls[decode]],
                    tmp_path / "router.log", env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(router, url, "the local-prefill router")
        claimed = _outcome(urls[decode], "claimed")
        for prompt in PROMPTS + [LONG]:
            assert _completion(url, prompt) == expected[prompt]
            assert _completion(url, prompt, stream=True) == expected[prompt]
        events = _router_events(url)
        assert events.get("local_prefill") == 2 * len(short)
        assert events.get("transfer_sent") == 2 * (len(PROMPTS) + 1 - len(short))
        assert _outcome(urls[decode], "claimed") == claimed + events["transfer_sent"]  # no transfer for the short
    finally:
        router.kill()
        router.wait()
    _assert_pools_return(urls, start)


def test_router_refuses_client_kv_transfer_params_and_instances_refuse_unsigned_ones(pd):
    _, urls, _, _ = pd
    bad = {"prompt": "1+1=", "kv_transfer_params": {"transfer_id": "ab" * 16, "decode_address": "10.0.0.1:1",
                                                    "signature": "00"}}
    assert httpx.post(urls["router"] + "/v1/completions", json=bad).status_code == 400
    response = httpx.post(urls["prefill0"] + "/v1/completions", json=bad)
    assert response.status_code == 400 and "kv_transfer_token" in response.text


def test_200_concurrent_streams_over_two_prefill_and_two_decode_instances(pd):
    _, urls, start, expected = pd
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(200)]

    async def stream(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        text, finish = "", None
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}
        async with client.stream("POST", urls["router"] + "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
        return text, finish

    async def run_all():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    assert asyncio.run(run_all()) == [expected[p] for p in prompts]
    for name in ("prefill0", "prefill1", "decode0", "decode1"):
        assert _info(urls[name])["outcomes"], f"{name} took no part"
    _assert_pools_return(urls, start)


def _drafts(url: str) -> float:
    return float(re.search(r"^jaxserve:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$",
                           httpx.get(url + "/metrics").text, re.M).group(1))


def test_a_speculating_decode_instance_keeps_the_colocated_outputs(pd):
    """decode1 guesses with n-gram over prompts whose KV it received: eight concurrent chat requests (spread
    over both decode instances) run past the answer's EOS, where the repeated tokens give the proposer
    matches, and every one returns the colocated tokens; decode1 verified guesses."""
    _, urls, start, _ = pd
    body = {"messages": [{"role": "user", "content": "12+34="}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "skip_special_tokens": False}

    def tokens(answer: dict) -> list[str]:
        return [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]

    colocated = tokens(httpx.post(urls["decode0"] + "/v1/chat/completions", json=body, timeout=60).json())
    before = _drafts(urls["decode1"])

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(urls["router"] + "/v1/chat/completions", json=body)
                                          for _ in range(8)))

    assert [tokens(r.json()) for r in asyncio.run(run_all())] == [colocated] * 8
    assert _drafts(urls["decode1"]) > before
    _assert_pools_return(urls, start)


def _reserve(info: dict, transfer_id: str, prompt_ids: list[int]) -> str:
    message = proto.encode(KEY, "reserve", transfer_id, token_ids=prompt_ids, cache_salt=None, timeout_s=TIMEOUT_S,
                           layout=info["kv_layout"])
    return proto.request(info["kv_transfer_address"], KEY, message, 5.0)["type"]


FILLERS = 2  # threads keeping each decode instance's pool full
ROUNDS = 3  # tries at catching the router with both decode pools full


def _fill_with_reservations(url: str) -> int:
    """Reserves the decode instance's pool until it refuses (the reservations expire after TIMEOUT_S)."""
    info, tokens = _info(url), [1] * 28  # 6 usable blocks each
    count = 0
    while _reserve(info, proto.new_transfer_id(), tokens) == "reserved":
        count += 1
    return count


def test_decode_pool_full_goes_elsewhere_then_waits_never_drops(pd):
    _, urls, start, expected = pd
    state = lambda: httpx.get(urls["router"] + "/router/state").json()["counts"]  # noqa: E731
    refused = state().get("transfer_refused", 0)
    assert _fill_with_reservations(urls["decode0"]) > 0
    assert _completion(urls["router"], LONG) == expected[LONG]  # decode0 refuses; decode1 takes it
    assert state()["transfer_refused"] == refused + 1
    assert _fill_with_reservations(urls["decode1"]) > 0
    # Both full, kept full by filler threads until the router was refused by both: it waits, then gets
    # through once the reservations expire (after TIMEOUT_S, a few at a time: reserves kept queued on each
    # instance take the freed blocks back at its next step). On a loaded machine a filler may answer late
    # and the client find blocks at its first try; such a round still must answer right, and a later round
    # must see the wait (at most ROUNDS).
    answers, waited = [], False
    for _ in range(ROUNDS):
        refused = state().get("transfer_refused", 0)
        answers.append(_completion_while_full(urls, state, refused))
        waited = state()["transfer_refused"] >= refused + 2
        if waited:
            break
    assert answers == [expected[LONG]] * len(answers)
    assert waited, f"the router was never refused by both decode instances in {ROUNDS} rounds"
    _assert_pools_return(urls, start)


def _completion_while_full(urls: dict, state, refused: int) -> tuple[str, str]:
    """A completion through the router started while filler threads keep both decode pools full; the
    fillers stop once the router was refused twice more than `refused` (or after 60 s)."""
    stop, result = threading.Event(), {}

    def keep_full(info: dict) -> None:
        while not stop.is_set():
            _reserve(info, proto.new_transfer_id(), [1] * 28)
    fillers = [threading.Thread(target=keep_full, args=(_info(urls[name]),))
               for name in ("decode0", "decode1") for _ in range(FILLERS)]
    for filler in fillers:
        filler.start()
    try:
        _fill_with_reservations(urls["decode0"])
        _fill_with_reservations(urls["decode1"])
        client = threading.Thread(target=lambda: result.update(answer=_completion(urls["router"], LONG)))
        client.start()
        deadline = time.monotonic() + 60
        while (state()["transfer_refused"] < refused + 2 and client.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.05)
    finally:
        stop.set()
        for filler in fillers:
            filler.join()
    client.join(60)
    return result["answer"]


def _params(address: str) -> dict:
    transfer_id = proto.new_transfer_id()
    return {"transfer_id": transfer_id, "decode_address": address,
            "signature": proto.sign_params(KEY, transfer_id, address)}


def _prefill(url: str, prompt: str, params: dict) -> str:
    response = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                         "kv_transfer_params": params}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["stop_reason"]


# (faults by message type, the prefill side's outcomes, the decode side's) — the decode side's claim of a
# transfer whose ack was lost races the prefill side's abort, so both are allowed there.
FAULTS = {
    "dropped_reserve": ({"reserve": "drop"}, {"timeout", "failed"}, {"recomputed"}),
    "delayed_reserve": ({"reserve": "delay"}, {"timeout"}, {"recomputed"}),
    "truncated_ready": ({"ready": "truncate"}, {"failed"}, {"recomputed"}),
    "truncated_ready_abort_dropped": ({"ready": "truncate", "abort": "drop"}, {"failed"}, {"recomputed"}),
    "delayed_ready": ({"ready": "delay"}, {"timeout", "failed"}, {"recomputed"}),
    "dropped_ack": ({"ready": "drop_reply"}, {"failed"}, {"recomputed", "claimed"}),
    "duplicated_ready": ({"ready": "duplicate"}, {"sent"}, {"claimed"}),
}


# Every fault through the host path; through the device path those where the "ready" is not one to
# truncate (its blocks are pulled, not carried).
FAULT_CASES = [("prefill0", name) for name in FAULTS] + [
    ("prefill1", name) for name in ("dropped_reserve", "delayed_ready", "dropped_ack", "duplicated_ready")]


@pytest.mark.parametrize("instance,scenario", FAULT_CASES, ids=[f"{i}-{s}" for i, s in FAULT_CASES])
def test_control_message_faults_end_in_a_local_re_prefill_or_a_transfer(pd, instance, scenario):
    _, urls, start, expected = pd
    faults, prefill_outcomes, decode_outcomes = FAULTS[scenario]
    prompt = _fresh(FAULT_CASES.index((instance, scenario)))
    answer = _completion(urls["decode1"], prompt)  # colocated, on the other decode instance
    decode = _info(urls["decode0"])
    with FaultProxy(decode["kv_transfer_address"], faults, delay_s=TIMEOUT_S + 0.5) as proxy:
        params = _params(proxy.address)
        outcome = _prefill(urls[instance], prompt, params)
        assert outcome.removeprefix("kv_transfer:") in prefill_outcomes, (outcome, proxy.seen)
        before = _info(urls["decode0"])["outcomes"]
        assert _completion(urls["decode0"], prompt, kv_transfer_params=params) == answer
        after = _info(urls["decode0"])["outcomes"]
        assert {k for k in ("claimed", "recomputed") if after.get(k, 0) > before.get(k, 0)} <= decode_outcomes
        if scenario == "duplicated_ready":
            assert proxy.replies[-1] == "ignored"  # the second copy is recognised, not installed twice
        _assert_pools_return(urls, start)


def test_transfer_timeout_makes_decode_re_prefill_locally(pd):
    processes, urls, start, expected = pd
    recomputed = _outcome(urls["decode0"], "recomputed")
    timeouts = _outcome(urls["prefill0"], "timeout") + _outcome(urls["prefill1"], "timeout")
    # the router learns decode0's KV endpoint now (it asks /pd/info once, which a stopped instance would not
    # answer: the router would mark it down and pick decode1)
    assert _completion(urls["router"], PROMPTS[0]) == expected[PROMPTS[0]]
    _signal_instance(processes["decode0"], signal.SIGSTOP)  # answers nothing: the prefill side's reserve times out
    try:
        with httpx.Client(timeout=60) as client:  # an idle router picks decode0 (the first of the least loaded)
            pending = client.build_request("POST", urls["router"] + "/v1/completions",
                                           json={"prompt": PROMPTS[3], "max_tokens": 3, "temperature": 0})
            result = {}
            thread = threading.Thread(target=lambda: result.update(r=client.send(pending)))
            thread.start()
            time.sleep(TIMEOUT_S + 1.0)
            _signal_instance(processes["decode0"], signal.SIGCONT)
            thread.join(60)
    finally:
        _signal_instance(processes["decode0"], signal.SIGCONT)
    response = result["r"]
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == expected[PROMPTS[3]]
    assert _outcome(urls["prefill0"], "timeout") + _outcome(urls["prefill1"], "timeout") == timeouts + 1
    assert _outcome(urls["decode0"], "recomputed") == recomputed + 1
    _assert_pools_return(urls, start)


def test_prefill_killed_mid_transfer_frees_the_reservation_and_another_prefill_serves(pd):
    processes, urls, start, expected = pd
    prompt = _fresh(100)
    answer = _completion(urls["decode1"], prompt)
    decode = _info(urls["decode0"])
    with FaultProxy(decode["kv_transfer_address"], {"ready": "hold_forward"}) as proxy:
        params = _params(proxy.address)
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params}

        def post():
            with contextlib.suppress(httpx.TransportError):  # the instance is killed before it answers
                httpx.post(urls["prefill1"] + "/v1/completions", json=body, timeout=30)
        thread = threading.Thread(target=post)
        thread.start()
        proxy.wait_for("ready", timeout_s=30)  # reserved on the decode side, the blocks on their way
        assert _info(urls["decode0"])["open_transfers"] == 1
        processes["prefill1"].send_signal(signal.SIGKILL)
        processes["prefill1"].wait()
        thread.join(30)
        failed = _outcome(urls["decode0"], "failed")
        proxy.release()  # the "ready" arrives now: the blocks it names are gone with their instance
        deadline = time.monotonic() + 3 * TIMEOUT_S + 5
        while _outcome(urls["decode0"], "failed") == failed:
            assert time.monotonic() < deadline, "the pull from a killed prefill instance did not fail"
            time.sleep(0.1)
    recomputed = _outcome(urls["decode0"], "recomputed")
    assert _completion(urls["decode0"], prompt, kv_transfer_params=params) == answer
    assert _outcome(urls["decode0"], "recomputed") == recomputed + 1
    up = ("prefill0", "decode0", "decode1")
    _assert_pools_return(urls, start, up)  # the reservation expired at its deadline
    # The router finds prefill1 gone and uses prefill0 for every prompt.
    assert [_completion(urls["router"], p) for p in PROMPTS] == [expected[p] for p in PROMPTS]
    _assert_pools_return(urls, start, up)


def test_no_prefill_instance_left_means_the_decode_instance_prefills(pd):
    processes, urls, start, expected = pd
    processes["prefill0"].send_signal(signal.SIGKILL)
    processes["prefill0"].wait()
    assert [_completion(urls["router"], p, stream=True) for p in PROMPTS] == [expected[p] for p in PROMPTS]
    _assert_pools_return(urls, start, ("decode0", "decode1"))


def test_killed_decode_instances_are_retried_elsewhere_then_a_clear_503(pd):
    processes, urls, start, expected = pd
    processes["decode0"].send_signal(signal.SIGKILL)
    processes["decode0"].wait()
    assert _completion(urls["router"], PROMPTS[0]) == expected[PROMPTS[0]]  # on decode1
    processes["decode1"].send_signal(signal.SIGKILL)
    processes["decode1"].wait()
    response = httpx.post(urls["router"] + "/v1/completions", json={"prompt": "1+2=", "max_tokens": 4}, timeout=60)
    assert response.status_code == 503 and "decode" in response.json()["error"]["message"]
