"""The engine in its own process (jaxserve/engine_process.py, `server.engine_process`, the default of
`jaxserve serve`), with the embedded model.

The wire (jaxserve/engine_wire.py) alone: deltas rebuild every cumulative output exactly. Then one engine
process for the module: driven directly, its outputs equal an in-process Engine's on the same requests
(greedy, seeded sampling with n=2, logprobs, prompt logprobs, stop strings and token ids, a prompt near
max_model_len, prefix-cache hits); aborts finish with "abort"; a refused configuration fails the start
with the engine's own message. Then the same process behind the OpenAI server: a selection of the HTTP
suites' tests (imported at the end of this file, so they run after the direct ones), and last, the engine
process killed mid-stream: open requests fail, /health answers 503, new requests 503, shutdown is clean.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import httpx
import pytest

from jaxserve.engine_client import EngineStats
from jaxserve.engine_wire import (OutputAssembler, OutputDeltas, decode_prepared, decode_stats, encode_prepared,
                                  encode_stats)
from jaxserve.input_processor import PreparedRequest
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams
from tests.test_server import AUTH, KEY, LiveServer, server_config

# ---- the wire alone ----------------------------------------------------------------------------------------------


def _prepared(request_id: str = "r", n: int = 1, logprobs: int | None = None) -> PreparedRequest:
    params = SamplingParams(n=n, temperature=1.0, logprobs=logprobs, stop=["xy"], seed=3)
    return PreparedRequest(request_id, "the prompt", [5, 6, 7], params, max_tokens=9, seed=11, priority=2,
                           cache_salt="salt", arrival_time=12.5, tenant="t",
                           kv_transfer_params={"transfer_id": "ab.0", "decode_address": "127.0.0.1:1"})


def test_prepared_and_stats_round_trip():
    prepared = _prepared(n=2, logprobs=3)
    assert decode_prepared(*encode_prepared(prepared)) == prepared
    stats = EngineStats(3, 1, 0.25, 40, 12, 2, ((1, 2), (3, 4)), (1.5, 1.0), 10, 7, 4, (4, 3),
                        kv_tier_usage=(("device", 0.25), ("host", 0.5)))
    assert decode_stats(encode_stats(stats)) == stats
    from jaxserve.core.kv_cache_manager import KVCacheStats

    with_kv = dataclasses.replace(stats, kv_cache=KVCacheStats(*range(len(dataclasses.fields(KVCacheStats)))))
    assert decode_stats(encode_stats(with_kv)) == with_kv


def _lp(token: int, value: float, rank: int) -> dict[int, Logprob]:
    return {token: Logprob(value, rank, f"<{token}>"), token + 1: Logprob(value - 1, 1, None)}


def test_deltas_rebuild_every_cumulative_output():
    """A run of cumulative outputs as an engine returns them (two sequences changing at different steps,
    logprobs, a text that is not a prefix of the previous one, prompt logprobs once, -inf) comes out of
    OutputDeltas -> OutputAssembler equal, each with lists of its own."""
    prepared = _prepared(n=2, logprobs=1)
    metrics = RequestMetrics(1.0, 2.0)
    prompt_lp = [None, _lp(6, -0.5, 2), _lp(7, float("-inf"), 9)]

    def out(seqs, finished=False, prompt_logprobs=None):
        return RequestOutput("r", "the prompt", [5, 6, 7], [
            CompletionOutput(i, text, tokens, cum, lps, fin, stop) for i, (text, tokens, cum, lps, fin, stop)
            in enumerate(seqs)], finished, 2, prompt_logprobs, metrics)

    a1, a2 = _lp(10, -0.25, 1), _lp(11, -1.5, 3)
    b1 = _lp(20, -0.125, 1)
    runs = [
        out([("a", [10], -0.25, [a1], None, None), ("", [], 0.0, [], None, None)], prompt_logprobs=prompt_lp),
        out([("a", [10], -0.25, [a1], None, None), ("b", [20], -0.125, [b1], None, None)], prompt_logprobs=prompt_lp),
        out([("ab c", [10, 11], -1.75, [a1, a2], None, None), ("b", [20], -0.125, [b1], None, None)],
            prompt_logprobs=prompt_lp),
        out([("ab", [10, 11], -1.75, [a1, a2], "stop", "xy"), ("b", [20], -0.125, [b1], "length", None)],
            finished=True, prompt_logprobs=prompt_lp),
    ]
    deltas, assembler = OutputDeltas(), OutputAssembler()
    assembler.add(prepared)
    rebuilt = [assembler.apply(deltas.encode(o)) for o in runs]
    for got, want in zip(rebuilt, runs, strict=True):
        assert got == want
    assert rebuilt[1].outputs[0].token_ids == [10]  # the third output's new tokens did not reach the second's list
    assert "r" not in assembler  # finished: forgotten on both sides
    assert len(deltas._sent) == 0


# ---- one engine process, driven directly -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config():
    return server_config(api_key=KEY)


@pytest.fixture(scope="module")
def process_engine(config):
    from jaxserve.engine_process import ProcessEngineClient

    engine = ProcessEngineClient(config, "warning")
    yield engine
    engine.close()


def _run(engine, requests: list[tuple[str, object, SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """Every output of each request, adding all of them first."""
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id=request_id)
    seen: dict[str, list[RequestOutput]] = {request_id: [] for request_id, _, _ in requests}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for output in engine.step():
            seen[output.request_id].append(output)
    return seen


def _assert_same(got: RequestOutput, want: RequestOutput) -> None:
    """Equal but for times, and log-probabilities within 1e-4 relative: the engine process may batch the
    requests differently (they reach it one frame at a time), which moves floats in their last digits.
    Tokens, text, ranks, finish and cache hits must be equal."""
    def floats(output):
        values = []
        for lps in [output.prompt_logprobs] + [seq.logprobs for seq in output.outputs]:
            for entry in lps or []:
                values += [lp.logprob for lp in (entry or {}).values()]
        return values + [seq.cumulative_logprob for seq in output.outputs if seq.cumulative_logprob is not None]

    def without_floats(output):
        def entries(lps):
            return None if lps is None else [None if entry is None else {t: (lp.rank, lp.decoded_token)
                                                                        for t, lp in entry.items()} for entry in lps]

        seqs = [dataclasses.replace(seq, logprobs=entries(seq.logprobs), cumulative_logprob=None)
                for seq in output.outputs]
        return dataclasses.replace(output, outputs=seqs, prompt_logprobs=entries(output.prompt_logprobs), metrics=None)

    assert without_floats(got) == without_floats(want)
    assert floats(got) == pytest.approx(floats(want), rel=1e-4, abs=1e-5)


REQUESTS = [
    ("greedy", "1234+5678=", SamplingParams(temperature=0, max_tokens=12)),
    ("sampled-n2", "99+1=", SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=10, logprobs=2)),
    ("prompt-logprobs", "505+250=", SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, logprobs=0)),
    ("stop-string", "31415+92653=", SamplingParams(temperature=0.8, seed=1, max_tokens=16, stop=["1"],
                                                  include_stop_str_in_output=False)),
    ("stop-token", {"prompt_token_ids": [1, 5, 6, 7, 8, 9]}, SamplingParams(temperature=0.8, seed=2, max_tokens=16,
                                                                           stop_token_ids=[4, 5, 6])),
    ("long", "1234567+7654321+11111+222=", SamplingParams(temperature=0, max_tokens=4)),
    ("cached", "1234+5678=", SamplingParams(temperature=0, max_tokens=3)),
]


def test_outputs_equal_the_in_process_engines(config, process_engine):
    from jaxserve.engine import Engine

    reference = Engine(config, progress=False)
    want = _run(reference, REQUESTS)
    got = _run(process_engine, REQUESTS)
    for request_id, _, _ in REQUESTS:
        final, expected = got[request_id][-1], want[request_id][-1]
        assert final.finished and expected.finished
        _assert_same(final, expected)
        assert final.metrics.first_token_time >= final.metrics.arrival_time
        for earlier in got[request_id][:-1]:  # every output on the way: a prefix of the final one
            for seq, last in zip(earlier.outputs, final.outputs, strict=True):
                assert last.text.startswith(seq.text) and last.token_ids[:len(seq.token_ids)] == seq.token_ids
    assert got["cached"][-1].num_cached_tokens > 0
    stats = process_engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= stats.prefix_cache_hits


def test_abort_finishes_the_request(process_engine):
    process_engine.add_request("1+1=", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                               request_id="to-abort")
    outputs = []
    while not outputs:
        outputs = process_engine.step()
    process_engine.abort_request("to-abort")
    while process_engine.has_unfinished_requests():
        outputs += process_engine.step()
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 200


def test_a_request_id_in_use_is_refused(process_engine):
    process_engine.add_request("1+1=", SamplingParams(temperature=0, max_tokens=50), request_id="twice")
    with pytest.raises(ValueError, match="already in use"):
        process_engine.add_request("1+1=", SamplingParams(temperature=0, max_tokens=5), request_id="twice")
    process_engine.abort_request("twice")
    while process_engine.has_unfinished_requests():
        process_engine.step()


def test_a_call_given_up_on_and_a_stopped_engine_leave_the_client_working(process_engine):
    """An info() call cancelled before its answer (here an error: not a PD instance) leaves the reader
    running; frames sent while the engine process is stopped (3 MB, past any pipe's room) do not block the
    sender; afterwards requests complete."""
    import asyncio

    async def give_up():
        task = asyncio.ensure_future(process_engine.info())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(give_up())
    with pytest.raises(Exception, match="info"):
        asyncio.run(process_engine.info())  # answered (an error), so the reader read the late answer first
    os.kill(process_engine.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        process_engine._send({"op": "ignored"}, b"x" * (3 << 20))
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(process_engine.process.pid, signal.SIGCONT)
    got = _run(process_engine, [("after-stop", "12+34=", SamplingParams(temperature=0, max_tokens=4))])
    assert got["after-stop"][-1].outputs[0].text == "46"


def test_process_bridge_fails_a_refused_request_with_the_engines_message():
    """A request the engine process refused (a ValueError in its enqueue) fails with that message on its
    group, as the engine thread's refusal does; the group's other request carries on."""
    import asyncio

    from jaxserve.engine_process import ProcessEngineClient
    from jaxserve.server.bridge import ProcessBridge
    from jaxserve.server.metrics import ServerMetrics

    class Client:  # what ProcessBridge calls of a ProcessEngineClient
        def __init__(self):
            self.handler, self.sent, self.assembler = None, [], OutputAssembler()

        def set_output_handler(self, handler):
            self.handler = handler

        def enqueue(self, prepared):
            self.sent.append(prepared.request_id)
            self.assembler.add(prepared)

        def abort_request(self, request_ids):
            pass

        refusals = staticmethod(ProcessEngineClient.refusals)

        def outputs_of(self, frames):
            return [o for f in frames for o in map(self.assembler.apply, f["outputs"]) if o is not None]

        def stats(self):
            return EngineStats()

    async def run():
        client = Client()
        bridge = ProcessBridge(client, ServerMetrics("m"), 8)
        bridge.start()
        group = bridge.submit([_prepared("a"), _prepared("b")])
        assert client.sent == ["a", "b"] and bridge.num_in_flight == 2
        refusal = "prompt_logprobs is not supported with parallel.expert > 1"
        client.handler({"op": "step", "rejected": [["a", refusal]], "stats": encode_stats(EngineStats()),
                        "outputs": [{"id": "b", "fin": True, "cached": 0, "m": [1.0, 2.0, 3.0],
                                     "seqs": [[0, 0, "46", [8, 10], None, None, "stop", None]]}]})
        with pytest.raises(ValueError, match="not supported"):
            async for _ in group:
                pass
        assert bridge.num_in_flight == 0 and not bridge._tracked

    asyncio.run(run())


def test_a_refused_configuration_fails_the_start_with_its_message(tmp_path, monkeypatch):
    """The engine's own ValueError, from an engine process started in a directory holding another
    `jaxserve` package (which it must not import: it would fail otherwise)."""
    from jaxserve.engine_process import ProcessEngineClient

    (tmp_path / "jaxserve").mkdir()
    (tmp_path / "jaxserve" / "__init__.py").write_text("raise ImportError('the working directory's jaxserve')\n")
    monkeypatch.chdir(tmp_path)
    config = server_config(**{"speculative.method": "ngram", "speculative.num_speculative_tokens": 2,
                              "speculative.synthetic_acceptance": 0.5})
    with pytest.raises(ValueError, match="bench-only"):
        ProcessEngineClient(config, "error")


def test_data_parallel_with_kv_tiers_in_an_engine_process(tmp_path):
    """Two replicas (fake CPU devices) with host and disk KV tiers, in an engine process: the adder's sums
    come back, and close() reaches the engine: its cached blocks are on disk after it."""
    from jaxserve.engine_process import ProcessEngineClient

    block_gib = 8192 / (1 << 30)  # one block of the embedded model
    config = server_config(**{"parallel.data": 2, "num_blocks": 64, "host_kv_gib": 2 * block_gib,
                              "disk_kv_path": str(tmp_path / "kv"), "disk_kv_gib": 0.01, "prefix_hash_seed": 4})
    engine = ProcessEngineClient(config, "warning")
    try:
        sums = {"505+250=": "755", "120+305=": "425", "777+111=": "888"}
        got = _run(engine, [(prompt, prompt, SamplingParams(temperature=0, max_tokens=6)) for prompt in sums])
        assert {prompt: outputs[-1].outputs[0].text for prompt, outputs in got.items()} == sums
        assert dict(engine.stats().kv_tier_usage).keys() == {"device", "host", "disk"}
        assert not list((tmp_path / "kv").rglob("*.kv"))
    finally:
        engine.close()
    assert engine.process.returncode == 0
    assert list((tmp_path / "kv").rglob("*.kv")), "close() did not write the cached blocks to disk"


# ---- the same engine process behind the OpenAI server ------------------------------------------------------------


@pytest.fixture(scope="module")
def live(config, process_engine):
    server = LiveServer(config, engine=process_engine)
    yield server
    server.stop()


# The HTTP suites' tests that exercise the engine's side, against this module's `live` (run after the direct
# tests above: pytest collects in definition order).
from tests.test_server import (  # noqa: E402, F401 (tests and fixtures)
    client, http, test_bad_input, test_chat, test_completions, test_completions_several_prompts_and_n,
    test_echo_and_logprobs, test_echo_with_logprobs_scores_the_prompt,
    test_models_health_metrics, test_stream_ends_with_done, test_stream_with_prompt_logprobs_zero_scores_no_prompt,
    test_streaming_chat_with_usage, test_streaming_completions_with_usage, test_tenant_is_the_api_key_whatever_the_header)
from tests.test_server_conformance import (  # noqa: E402, F401
    test_continuous_usage_stats, test_request_id_names_the_response_and_add_special_tokens,
    test_return_tokens_as_token_ids, test_stream_chunks_carry_object_and_one_choice_each, test_tokenize_and_detokenize)


def test_the_server_process_runs_no_engine_thread(live, client):
    """With the engine in its own process the bridge has no engine thread: the event loop sends requests
    and the client's reader thread hands it each step's outputs."""
    import threading

    assert client.completions.create(model="tiny-adder", prompt="12+34=", temperature=0).choices[0].text == "46"
    names = {thread.name for thread in threading.enumerate()}
    assert "jaxserve-engine" not in names and "jaxserve-engine-reader" in names


def test_engine_process_death_fails_open_requests_and_health(live):
    """Last (it kills the module's engine process): a request waiting on the engine fails with a 500 that
    says so, /health answers 503, new requests 503; the server shuts down cleanly afterwards."""
    import threading

    engine_pid = live.engine.process.pid
    result = {}
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as http_client:
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=lambda: result.update(r=http_client.post(
                "/v1/completions", json={"model": "tiny-adder", "prompt": "1+1=", "max_tokens": 8})))
            thread.start()
            time.sleep(0.5)
            assert thread.is_alive()  # the engine process is stopped: the request waits
        finally:
            os.kill(engine_pid, signal.SIGKILL)
        thread.join(30)
        response = result["r"]
        assert response.status_code == 500 and "engine" in response.json()["error"]["message"]
    deadline = time.monotonic() + 10  # (new connections: the server closes one that answered a 500)
    while (health := httpx.get(live.url + "/health")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
    refused = httpx.post(live.url + "/v1/completions", headers=AUTH,
                         json={"model": "tiny-adder", "prompt": "1+1=", "max_tokens": 2})
    assert refused.status_code == 503
