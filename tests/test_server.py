"""The OpenAI-compatible server on loopback, serving the embedded model: the `openai` client (completions,
chat, streaming, usage, vLLM's extra fields), bad inputs refused before queueing (BAD_INPUTS: the right
4xx, the parameter named, the server still serving), size limits, API-key bypass attempts, the CLI.

One server per module (a uvicorn thread in this process); `LiveServer` is shared with test_server_load.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from jaxserve.config import EngineConfig, load_config
from tests.conftest import ROOT, TINY_MODEL

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny-adder"


def server_config(**overrides) -> EngineConfig:
    """The embedded model's config on an ephemeral port; shapes compile as the tests first use them."""
    return load_config(TINY_CONFIG, **{"port": 0, "access_log": False, "precompile": False, **overrides})


class LiveServer:
    """A real uvicorn server for `config` on an ephemeral loopback port, in a background thread."""

    def __init__(self, config: EngineConfig, engine=None):
        from jaxserve.engine import Engine
        from jaxserve.server.cli import build_server

        self.engine = engine or Engine(config, progress=False)
        self.server = build_server(config, self.engine, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.bridge = self.server.bridge

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request (aborts and finishes have landed)."""
        deadline = time.monotonic() + timeout
        while self.bridge.num_in_flight or self.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def raw_http(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes exactly as written (no client-side path normalisation); the status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.fixture(scope="module")
def live():
    server = LiveServer(server_config(api_key=KEY))
    yield server
    server.stop()


# `client` and `http` reach whichever module's `live` server requests them (test_server_conformance imports them).
@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as session:
        yield session


# ---- the openai client --------------------------------------------------------------------------------------
def test_completions(client):
    result = client.completions.create(model=MODEL, prompt="12+34=", max_tokens=5, temperature=0)
    assert result.choices[0].text == "46" and result.choices[0].finish_reason == "stop"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (7, 3, 10)
    assert result.model == MODEL and result.object == "text_completion"


def test_completions_several_prompts_and_n(client):
    result = client.completions.create(model=MODEL, prompt=["1+2=", "30+40="], n=2, temperature=1.0, seed=5,
                                       max_tokens=4)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 5 + 7
    assert result.usage.completion_tokens >= 4  # at least one token per choice
    greedy = client.completions.create(model=MODEL, prompt=[[1, 5, 14, 6, 15], [1, 7, 4, 14, 8, 4, 15]],
                                       temperature=0)  # "<s>1+2=", "<s>30+40="
    assert [c.text for c in greedy.choices] == ["3", "70"]


def test_chat(client):
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12+34"}],
                                            max_completion_tokens=5)
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "46"
    assert choice.finish_reason == "stop" and result.object == "chat.completion"
    assert result.usage.prompt_tokens == 7 and result.usage.completion_tokens == 3  # "<s>12+34=" and "46</s>"


def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(client, http):
    """vLLM's chat echo: the reply's role is the assistant's after a generation prompt, else the last
    message's, and echo prepends the last message's text when that message has the reply's role."""
    def chat(messages, **extra):
        result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body=extra)
        return result.choices[0].message.role, result.choices[0].message.content

    user = {"role": "user", "content": "12+34"}
    partial = {"role": "assistant", "content": "The sum is "}
    assert chat([user, partial], echo=True, add_generation_prompt=False) == ("assistant", "The sum is 46")
    assert chat([user, partial], echo=False, add_generation_prompt=False) == ("assistant", "46")
    assert chat([user], echo=True) == ("assistant", "46")  # the generation prompt's role is not the user's
    assert chat([user], echo=True, add_generation_prompt=False) == ("user", "12+3446")
    body = {"messages": [user, partial], "echo": True, "add_generation_prompt": False, "stream": True,
            "temperature": 0, "n": 1}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert deltas[0]["role"] == "assistant" and deltas[1]["content"] == "The sum is "
    assert "".join(d.get("content") or "" for d in deltas) == "The sum is 46"


def test_tools_reach_the_template_with_tool_choice_none(client, http):
    """With tool_choice 'none' the model is shown the tools (through the chat template) and answers in text;
    the tiny model's template ignores them, so the answer and the prompt's tokens are those without tools."""
    tools = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {}}}]
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12+34"}],
                                            temperature=0, tools=tools, tool_choice="none")
    assert result.choices[0].message.content == "46" and result.usage.prompt_tokens == 7
    counted = http.post("/tokenize", json={"messages": [{"role": "user", "content": "12+34"}], "tools": tools})
    assert counted.status_code == 200 and counted.json()["count"] == 7


def test_completions_take_a_text_response_format(client):
    result = client.completions.create(model=MODEL, prompt="12+34=", temperature=0,
                                       extra_body={"response_format": {"type": "text"}})
    assert result.choices[0].text == "46"


def test_streaming_completions_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="505+250=", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "755"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_streaming_chat_with_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "999+1"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "1000"
    assert chunks[-1].usage.prompt_tokens == 7 and chunks[-1].usage.completion_tokens == 5  # "<s>999+1="


def test_stream_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "7+8=", "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == "15"


def test_stream_with_prompt_logprobs_zero_scores_no_prompt(live, http):
    """stream=true accepts prompt_logprobs=0 and sends none (as vLLM); the engine is not asked for them,
    so the prompt is served from the prefix cache like any other (scoring it would bypass the cache)."""
    body = {"prompt": "1234+5678=", "max_tokens": 2, "stream": True, "prompt_logprobs": 0, "cache_salt": "plp-0"}

    def stream() -> list[str]:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line]

    assert "prompt_logprobs" not in "".join(stream())
    live.wait_idle()
    before = live.engine.stats().prefix_cache_hits
    stream()
    assert live.engine.stats().prefix_cache_hits - before >= 8  # "<s>1234+5678=": two whole blocks of 4


def test_vllm_extra_fields(client):
    extra = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.0, "cache_salt": "tenant-a", "priority": 3,
             "skip_special_tokens": True, "spaces_between_special_tokens": True, "an_unknown_field": [1, 2]}
    result = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, extra_body=extra)
    assert result.choices[0].text == "46"
    long = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, max_tokens=8,
                                     extra_body={"ignore_eos": True, "min_tokens": 8})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 8
    stopped = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, stop=["6"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("4", "stop")
    kept = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, stop="6",
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == "46"
    by_id = client.completions.create(model=MODEL, prompt="12+34=", temperature=0,
                                      extra_body={"stop_token_ids": [10]})  # "6"
    assert by_id.choices[0].text == "4" and by_id.choices[0].model_extra["stop_reason"] == 10


def test_echo_and_logprobs(client):
    echoed = client.completions.create(model=MODEL, prompt="1+1=", temperature=0, echo=True)
    assert echoed.choices[0].text == "1+1=2"
    result = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == ["4", "6", "</s>"] and logprobs.text_offset == [0, 1, 2]
    assert all(len(top) >= 2 for top in logprobs.top_logprobs) and logprobs.token_logprobs[0] <= 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12+34"}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["4", "6", "</s>"]
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token for entry in content)


def test_echo_with_logprobs_scores_the_prompt(client, http):
    """lm-evaluation-harness's loglikelihood call (echo, logprobs=1, max_tokens 0 or 1) in vLLM's legacy
    format: the prompt's tokens first (the first one unscored), then the generated one; text offsets run on
    through both; the same values as vLLM's prompt_logprobs field."""
    prompt_tokens = ["<s>", "1", "2", "+", "3", "4", "="]
    scored = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, echo=True, logprobs=1,
                                       max_tokens=0, extra_body={"prompt_logprobs": 2})
    choice = scored.choices[0]
    assert choice.text == "12+34=" and choice.logprobs.tokens == prompt_tokens
    assert choice.logprobs.text_offset == [0, 3, 4, 5, 6, 7, 8]  # each token's decoded length: "<s>" is 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    for token, top in zip(prompt_tokens[1:], choice.logprobs.top_logprobs[1:]):
        assert token in top and 1 <= len(top) <= 2  # the prompt token and the top-1
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == 7 and prompt_logprobs[0] is None
    for token_logprob, entry in zip(choice.logprobs.token_logprobs[1:], prompt_logprobs[1:]):
        first = next(iter(entry.values()))  # the prompt token first, keyed by its id
        assert first["logprob"] == pytest.approx(token_logprob) and first["rank"] >= 1
        assert {lp["rank"] for lp in entry.values()} >= {1, 2} and set(first) == {"logprob", "rank", "decoded_token"}
    assert list(prompt_logprobs[6])[0] == "15" and len(prompt_logprobs[6]) in (2, 3)  # "=" (id 15), then the top-2

    with_one = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, echo=True, logprobs=1,
                                         max_tokens=1).choices[0]
    assert with_one.text == "12+34=4" and with_one.logprobs.tokens == prompt_tokens + ["4"]
    assert with_one.logprobs.token_logprobs[:-1] == pytest.approx(choice.logprobs.token_logprobs)
    assert with_one.logprobs.text_offset[-1] == 9 and with_one.logprobs.token_logprobs[-1] <= 0
    assert with_one.model_extra["prompt_logprobs"] is not None  # echo with logprobs asks for them (as vLLM)

    chat = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    plain = http.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_echo_of_a_request_aborted_before_its_prompt_was_scored():
    """An abort (drain timeout, shutdown) can end an echo + logprobs request before its prompt log-probs
    exist: its text comes back with null logprobs for the prompt's tokens, never an error."""
    from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
    from jaxserve.server.logprobs_format import echo_choice
    from jaxserve.tokenizer import Tokenizer

    generated = CompletionOutput(0, "4", [8], -0.1, [{8: Logprob(-0.1, 1, "4")}], finish_reason="abort")
    output = RequestOutput("0", "1+1=", [1, 5, 14, 5, 15], [generated], finished=True)
    text, logprobs = echo_choice("1+1=", output, generated, 5, 1, Tokenizer.from_dir(TINY_MODEL))
    assert text == "1+1=4" and logprobs.tokens == ["<s>", "1", "+", "1", "=", "4"]
    assert logprobs.token_logprobs == [None] * 5 + [-0.1] and logprobs.top_logprobs[:5] == [None] * 5
    assert logprobs.text_offset == [0, 3, 4, 5, 6, 7]


def test_no_tokenizer_worker_answers_503_until_one_is_back(live, http, monkeypatch):
    """Workers that die and cannot be re-spawned: their calls fail (500), then requests and /health answer
    503 at once (no request waits forever); once a re-spawn succeeds the server serves again."""
    pool = live.server.config.app.state.serving.tokens

    async def cannot_start():
        raise RuntimeError("no worker today")

    monkeypatch.setattr(pool, "_spawn", cannot_start)
    for worker in list(pool._workers):
        worker.process.kill()
    statuses = [http.post("/v1/completions", json={"prompt": "1+1="}).status_code for _ in range(3)]
    assert statuses[-1] == 503 and set(statuses) <= {500, 503}, statuses
    unavailable = http.post("/v1/completions", json={"prompt": "1+1="})
    assert unavailable.status_code == 503 and "no tokenizer worker is running" in unavailable.json()["error"]["message"]
    assert unavailable.headers["retry-after"] == "1"
    assert httpx.get(live.url + "/health").status_code == 503
    monkeypatch.undo()  # the next retries start workers
    deadline = time.monotonic() + 20
    while httpx.get(live.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "no tokenizer worker came back"
        time.sleep(0.05)
    assert http.post("/v1/completions", json={"prompt": "1+1=", "temperature": 0}).json()["choices"][0]["text"] == "2"


def test_models_health_metrics(live, http, client):
    client.completions.create(model=MODEL, prompt="1+1=", temperature=0, max_tokens=2)  # the request series exist
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 32
    assert httpx.get(live.url + "/health").status_code == 200  # no key needed
    metrics = httpx.get(live.url + "/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "request_success_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
        assert f"jaxserve:{name}{{" in text, name
    generated = next(line for line in text.splitlines() if line.startswith("jaxserve:generation_tokens_total"))
    assert float(generated.split()[-1]) > 0


def test_engine_thread_sleeps_when_idle(live, client):
    live.wait_idle()
    calls = []
    step = live.engine.step
    live.engine.step = lambda *args, **kwargs: calls.append(1) or step(*args, **kwargs)
    try:
        time.sleep(0.3)
        assert calls == [], "the engine thread steps while idle (busy spin)"
        client.completions.create(model=MODEL, prompt="1+1=", temperature=0)
        live.wait_idle()
        woken = len(calls)
        assert woken > 0
        time.sleep(0.3)
        assert len(calls) == woken
    finally:
        del live.engine.step


# ---- bad inputs: refused before anything is queued, with a 4xx that names the parameter --------------------------
GOOD = {"prompt": "12+34=", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "12+34"}]}
# Case groups: 1 prompt past the context, 2 prompt + max_tokens past it, 3 max/min_tokens, 4 temperature, 5 other
# sampling ranges, 6 n, 7 logprobs, 8 unknown model, 9 malformed body, 10 non-UTF-8 body, 11 empty prompt, 12 ids
# outside the vocabulary, 13 stop lists, 15 hostile chat templates, 21 seed range, 22 non-text content, - unsupported.
BAD_INPUTS = [  # (case group, route, body, status, param, words in the message)
    ("1", "completions", {"prompt": "1+" * 20 + "1="}, 400, "prompt", "maximum model length"),
    ("1", "chat", {"messages": [{"role": "user", "content": "1+" * 20}]}, 400, "messages", "maximum model length"),
    ("2", "completions", {"prompt": "12+34=", "max_tokens": 30}, 400, "max_tokens", "max_model_len"),
    ("3", "completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("3", "chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("3", "completions", {**GOOD, "max_tokens": 0, "echo": True, "stream": True}, 400, "echo", "stream=true"),
    ("3", "completions", {**GOOD, "min_tokens": 5}, 400, "min_tokens", "less than or equal to max_tokens"),
    ("4", "completions", {**GOOD, "temperature": -1}, 400, "temperature", "non-negative"),
    ("4", "completions", b'{"prompt": "1+1=", "temperature": NaN}', 400, "temperature", "finite"),
    ("5", "completions", {**GOOD, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("5", "completions", {**GOOD, "top_k": -2}, 400, "top_k", "top_k"),
    ("5", "completions", {**GOOD, "min_p": 2}, 400, "min_p", "[0, 1]"),
    ("5", "completions", {**GOOD, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("5", "completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty", "greater than zero"),
    ("6", "completions", {**GOOD, "n": 10**6}, 400, "n", "less than or equal to 128"),
    ("6", "completions", {**GOOD, "n": 0}, 400, "n", "greater than or equal to 1"),
    ("6", "completions", {**GOOD, "n": 2, "temperature": 0}, 400, "n", "greedy"),
    ("6", "completions", {**GOOD, "n": 100, "temperature": 1}, 400, "n", "at most 64"),
    ("7", "completions", {**GOOD, "logprobs": 10**6}, 400, "logprobs", "less than or equal"),
    ("7", "completions", {**GOOD, "logprobs": 21}, 400, "logprobs", "at most 20"),
    ("7", "completions", {**GOOD, "logprobs": -2}, 400, "logprobs", "greater than or equal to -1"),
    ("7", "completions", {**GOOD, "prompt_logprobs": 21}, 400, "prompt_logprobs", "at most 20"),
    ("7", "completions", {**GOOD, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "stream=true"),
    ("7", "chat", {**CHAT, "prompt_logprobs": -2}, 400, "prompt_logprobs", "greater than or equal to -1"),
    ("7", "completions", {**GOOD, "echo": True, "logprobs": 1, "stream": True}, 400, "echo", "stream=true"),
    ("7", "chat", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("8", "completions", {**GOOD, "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist."),
    ("9", "completions", b'{"prompt": "1+1=",', 400, None, "not valid UTF-8 JSON"),
    ("9", "completions", b'[1, 2]', 400, None, "must be a JSON object"),
    ("9", "completions", {"max_tokens": 4}, 400, "prompt", "Field required"),
    ("9", "chat", {"max_tokens": 4}, 400, "messages", "Field required"),
    ("9", "completions", {**GOOD, "n": "many"}, 400, "n", "valid integer"),
    ("10", "completions", b'{"prompt": "\xff\xfe1+1="}', 400, None, "not valid UTF-8 JSON"),
    ("11", "completions", {"prompt": ""}, 400, "prompt", "at least 1 character"),
    ("11", "completions", {"prompt": []}, 400, "prompt", "at least 1 item"),
    ("-", "completions", {"prompt": [[1, 5], "1+1="]}, 400, "prompt", "none of the accepted types"),
    ("11", "chat", {"messages": []}, 400, "messages", "at least 1 item"),
    ("12", "completions", {"prompt": [1, 5, 99]}, 400, "prompt", "out of vocabulary"),
    ("12", "completions", {**GOOD, "stop_token_ids": [999]}, 400, "stop_token_ids", "out of vocabulary"),
    ("12", "completions", {**GOOD, "logit_bias": {"5": 10}}, 400, "logit_bias", "not supported"),
    ("13", "completions", {**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
    ("13", "completions", {**GOOD, "stop": ["x"] * 33}, 400, "stop", "at most 32"),
    ("15", "chat", {**CHAT, "chat_template": "{{ 7 * 7 }}"}, 400, "chat_template", "trust_request_chat_template"),
    ("15", "chat", {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs",
     "add_generation_prompt"),
    ("15", "chat", {**CHAT, "chat_template_kwargs": {"eos_token": "x"}}, 400, "chat_template_kwargs", "eos_token"),
    ("15", "chat", {**CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", "messages"),
    ("21", "completions", {**GOOD, "seed": 2**63}, 400, "seed", "less than or equal"),
    ("22", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", "only text parts"),
    ("-", "chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "tool-call parser"),
    ("-", "chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     400, "tool_choice", "tool_choice='required' with tools"),
    ("-", "chat", {**CHAT, "tools": [{"type": "web_search"}], "tool_choice": "none"}, 400, "tools", "'function'"),
    ("-", "chat", {**CHAT, "tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, 400, "tools",
     "Field required"),
    ("-", "chat", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format", "structured output"),
    ("-", "completions", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, 400,
     "response_format", "structured output"),
    ("-", "completions", {**GOOD, "suffix": "x"}, 400, "suffix", "not supported"),
    ("-", "completions", {**GOOD, "priority": "high"}, 400, "priority", "valid integer"),
    ("-", "completions", {**GOOD, "cache_salt": ""}, 400, "cache_salt", "at least 1 character"),
    ("-", "completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream=true"),
]


@pytest.mark.parametrize("row,route,body,status,param,words", BAD_INPUTS,
                         ids=[f"C{case[0]}-{case[4]}-{i}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input(http, row, route, body, status, param, words):
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    assert words in error["message"], error["message"]
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


def test_wrong_content_type(http):
    response = http.post("/v1/completions", content=json.dumps(GOOD), headers={"content-type": "text/plain"})
    assert response.status_code == 400 and "application/json" in response.json()["error"]["message"]


def test_still_serving_after_bad_inputs(live, client):
    result = client.completions.create(model=MODEL, prompt="12+34=", temperature=0)
    assert result.choices[0].text == "46"
    live.wait_idle()
    assert live.engine.kv_cache.usage == 0.0


# ---- size limits ------------------------------------------------------------------------------------------------
def test_body_too_large(live, http):
    big = {"prompt": "1+1=", "user": "x" * (1 << 20)}
    response = http.post("/v1/completions", json=big)
    assert response.status_code == 413 and response.json()["error"]["type"] == "RequestEntityTooLargeError"
    chunked = http.post("/v1/completions", content=iter([b"{" + b" " * (1 << 19)] * 3),
                        headers={"content-type": "application/json"})  # no Content-Length: counted while read
    assert chunked.status_code == 413


def test_headers_too_large(live, http):
    assert http.get("/v1/models", headers={"x-big": "a" * (20 << 10)}).status_code == 431
    assert http.get("/v1/models", headers={f"x-h{i}": "1" for i in range(300)}).status_code == 431
    try:  # far past the limit: uvicorn's h11 bound refuses it before the app sees it (400 or a closed socket)
        status = http.get("/v1/models", headers={"x-huge": "a" * (4 << 20)}).status_code
        assert status in (400, 431)
    except httpx.TransportError:
        pass
    assert http.get("/v1/models").status_code == 200


# ---- authentication ---------------------------------------------------------------------------------------------
BYPASS_ATTEMPTS = [
    b"GET /v1/models HTTP/1.1", b"GET //v1/models HTTP/1.1", b"GET /v1%2Fmodels HTTP/1.1",
    b"GET /%2Fv1/models HTTP/1.1", b"GET /v1/./models HTTP/1.1", b"GET /health/../v1/models HTTP/1.1",
    b"GET /v1/models/ HTTP/1.1", b"GET /V1/MODELS HTTP/1.1", b"GET http://127.0.0.1/v1/models HTTP/1.1",
    b"GET //health HTTP/1.1", b"GET /health%2F..%2Fv1/models HTTP/1.1", b"GET /no/such/route HTTP/1.1",
    b"POST /health HTTP/1.1", b"GET /docs HTTP/1.1", b"GET /openapi.json HTTP/1.1",
]


@pytest.mark.parametrize("request_line", BYPASS_ATTEMPTS, ids=lambda line: line.decode())
@pytest.mark.parametrize("authorization", [None, b"Bearer wrong-key", b"Bearer ", b"Basic dGVzdC1rZXk=",
                                           b"Bearer test-key2", b"test-key"])
def test_auth_bypass_refused(live, request_line, authorization):
    head = request_line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if authorization is not None:
        head += b"Authorization: " + authorization + b"\r\n"
    status, body = raw_http(live.port, head + b"Content-Length: 0\r\n\r\n")
    assert status == 401, (status, body)
    assert json.loads(body)["error"]["type"] == "AuthenticationError"


def test_auth_accepts_the_key_and_leaves_health_and_metrics_open(live):
    for line in (b"GET /health HTTP/1.1", b"GET /metrics HTTP/1.1"):
        status, _ = raw_http(live.port, line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 200
    status, body = raw_http(live.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                       b"Authorization: bearer  test-key \r\n\r\n")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def test_tenant_is_the_api_key_whatever_the_header(live, http, monkeypatch):
    """With API keys the tenant header is ignored: a client can neither mint a tenant per request nor claim
    another key's, so `scheduler.policy: fair` shares by key. (test_server_load.py: the header without keys.)"""
    from jaxserve.server.middleware import tenant_of_key

    tenants = []
    enqueue = live.engine.enqueue
    monkeypatch.setattr(live.engine, "enqueue", lambda prepared: tenants.append(prepared.tenant) or enqueue(prepared))
    for header in ("tenant-1", "tenant-2", tenant_of_key(b"another-key"), "a b"):  # "a b": malformed, not even read
        response = http.post("/v1/completions", json=GOOD, headers={"x-tenant-id": header})
        assert response.status_code == 200, response.text
    assert tenants == [tenant_of_key(KEY.encode())] * 4


# ---- packaging and CLI ------------------------------------------------------------------------------------------
def test_engine_import_path_has_no_server_dependencies():
    code = ("import sys, jaxserve, jaxserve.engine, jaxserve.llm, jaxserve.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'starlette', 'httpx')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    client_only = ("import sys, jaxserve.bench.serve; "
                   "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'jax'); assert not bad, bad")
    subprocess.run([sys.executable, "-c", client_only], check=True, cwd=ROOT)  # the benchmark client: no JAX


def test_cli_overrides():
    from jaxserve.server.cli import _config_from_args, main

    config, log_level = _config_from_args(["--port", "9001", "--api-key", "a", "--api-key", "b", "--max-num-seqs",
                                           "8", "--policy", "fair", "--host", "0.0.0.0", "--token-buckets", "[16, 64]",
                                           "--tenant-header", "null", "--log-level", "warning"])
    assert (config.server.port, config.server.api_key, config.server.host) == (9001, ("a", "b"), "0.0.0.0")
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.policy == "fair"
    assert config.runner.token_buckets == (16, 64) and config.server.tenant_header is None
    assert config.cache.block_size == 4 and log_level == "warning"  # the rest comes from configs/tiny.yaml
    served, _ = _config_from_args(["--config", str(ROOT / "configs" / "serve-tiny.yaml"), "--port", "0"])
    assert served.scheduler.policy == "fair" and served.server.tenant_header == "x-tenant-id"
    assert served.server.port == 0 and served.server.max_queued_requests == 1024
    assert main(["--max-queued-requests", "0"]) == 2
    assert main(["--policy", "random"]) == 2


def test_cli_takes_the_model_as_vllm_serve_does(capsys):
    from jaxserve.server.cli import _config_from_args, main

    model = str(TINY_MODEL)
    assert _config_from_args([model, "--port", "9001"])[0].model.path == model
    assert _config_from_args(["--port", "9001", model])[0].model.path == model
    assert _config_from_args([model, "--model", model])[0].model.path == model
    assert main([model, "--model", "/elsewhere"]) == 2
    assert "the model is given twice" in capsys.readouterr().err


def test_bench_serve(live, tmp_path, capsys):
    from jaxserve.cli import main as jaxserve_main

    output = tmp_path / "serve.json"
    common = ["bench", "serve", "--base-url", live.url, "--api-key", KEY, "--num-prompts", "24",
              "--random-input-len", "6", "--random-output-len", "8", "--random-range-ratio", "0.5", "--ignore-eos",
              "--disable-tqdm", "--goodput", "ttft:60000", "tpot:60000"]
    assert jaxserve_main([*common, "--request-rate", "inf", "--output-json", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["completed"] == 24 and result["failed"] == 0 and "api_key" not in result["args"]
    assert result["total_output_tokens"] == sum(result["output_lens"]) > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert all(len(itl) <= n - 1 for itl, n in zip(result["itls"], result["output_lens"]))  # chunks may coalesce
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"median_{name}_ms"] > 0 and result[f"p99_{name}_ms"] >= result[f"median_{name}_ms"]
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Request goodput (req/s):" in printed
    chat = [*common, "--backend", "openai-chat", "--request-rate", "200", "--max-concurrency", "4",
            "--header", "X-Tenant-Id=bench", "--metric-percentiles", "50,90"]
    assert jaxserve_main(chat) == 0
    assert "P90 TTFT (ms):" in capsys.readouterr().out
    assert jaxserve_main([*common, "--goodput", "latency:5"]) == 2
    assert jaxserve_main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--disable-tqdm"]) == 2
    assert "401" in capsys.readouterr().err  # no key: the test request fails, clearly
