"""The OpenAI server as vLLM's behaves, on loopback with the embedded model: stream chunks (object, one
choice each, continuous usage), vLLM's model card, tokenize / detokenize, probes, accepted-but-unsupported
fields refused by name, return_tokens_as_token_ids, request volume caps, the API key from the environment.
(test_server_hardening.py: tokenization that cannot stall the server, connection timeouts.)
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_server import AUTH, KEY, MODEL, LiveServer, client, http, server_config  # noqa: F401 (fixtures)

MAX_REQUEST_TOKENS, MAX_REQUEST_LOGPROBS = 1000, 2000


@pytest.fixture(scope="module")
def live():
    server = LiveServer(server_config(api_key=KEY, max_request_tokens=MAX_REQUEST_TOKENS,
                                      max_request_logprobs=MAX_REQUEST_LOGPROBS, max_logprobs=-1))
    yield server
    server.stop()


def sse_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# ---- streams ----------------------------------------------------------------------------------------------------
def test_stream_chunks_carry_object_and_one_choice_each(http, client):
    """n=2 over two prompts: every chunk names its object and carries one choice; a client reading
    choices[0] of each chunk rebuilds every choice (text and finish reason) as the non-streamed answer."""
    body = {"prompt": ["12+34=", "505+250="], "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6}
    chunks = sse_chunks(http, "/v1/completions", body)
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    texts, finishes = {}, {}
    for chunk in client.completions.create(model=MODEL, stream=True, **body):
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    whole = client.completions.create(model=MODEL, **body)
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    assert finishes == {c.index: c.finish_reason for c in whole.choices}

    chat = {"messages": [{"role": "user", "content": "12+34"}], "n": 3, "temperature": 1.0, "seed": 3,
            "max_tokens": 5}
    chunks = sse_chunks(http, "/v1/chat/completions", chat)
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    contents, finishes = {}, {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        contents[choice["index"]] = contents.get(choice["index"], "") + (choice["delta"].get("content") or "")
        finishes[choice["index"]] = choice["finish_reason"] or finishes.get(choice["index"])
    whole = client.chat.completions.create(model=MODEL, **chat)
    assert contents == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices} and None not in finishes.values()


def test_continuous_usage_stats(http):
    body = {"prompt": ["12+34=", "1+1="], "n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 5,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(http, "/v1/completions", body)
    assert all("usage" in c for c in chunks)
    final = chunks[-1]
    assert final["choices"] == [] and final["object"] == "text_completion"
    generated: dict[int, int] = {}
    for chunk in chunks[:-1]:
        index, usage = chunk["choices"][0]["index"], chunk["usage"]
        assert usage["prompt_tokens"] == (7 if index < 2 else 5)  # "<s>12+34=" and "<s>1+1="
        assert usage["completion_tokens"] >= generated.get(index, 0)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        generated[index] = usage["completion_tokens"]
    assert final["usage"]["completion_tokens"] == sum(generated.values())
    assert final["usage"]["prompt_tokens"] == 7 + 5  # each prompt counted once, however many its choices

    chat = sse_chunks(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1"}],
                                                     "stream_options": {}})  # include_usage defaults to true
    assert "usage" not in chat[0] and chat[-1]["usage"]["completion_tokens"] == 2  # "2</s>"


def test_priority_is_one_int_for_every_prompt(live, http, monkeypatch):
    priorities = []
    enqueue = live.engine.enqueue
    monkeypatch.setattr(live.engine, "enqueue", lambda p: priorities.append(p.priority) or enqueue(p))
    response = http.post("/v1/completions", json={"prompt": ["1+1=", "2+2=", "3+3="], "priority": -5,
                                                  "max_tokens": 3})
    assert response.status_code == 200 and priorities == [-5, -5, -5]
    refused = http.post("/v1/completions", json={"prompt": ["1+1=", "2+2="], "priority": [1, 2]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"


# ---- fields -------------------------------------------------------------------------------------------------------
REFUSED = [("completions", {"best_of": 3}, "best_of"), ("completions", {"n": 2, "best_of": 4}, "best_of"),
           ("completions", {"use_beam_search": True}, "use_beam_search"),
           ("completions", {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
           ("completions", {"guided_json": {"type": "object"}}, "guided_json"),
           ("completions", {"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
           ("completions", {"allowed_token_ids": [4, 5]}, "allowed_token_ids"),
           ("completions", {"length_penalty": 0.5}, "length_penalty"),
           ("chat", {"modalities": ["text", "audio"]}, "modalities"), ("chat", {"store": True}, "store"),
           ("chat", {"tool_choice": "required"}, "tool_choice"),
           ("chat", {"functions": [{"name": "f"}]}, "functions")]
NO_OPS = [("completions", {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "guided_json": None}),
          ("chat", {"n": 2, "best_of": 2, "temperature": 1.0, "store": False, "modalities": ["text"],
                    "tool_choice": "none", "user": "u-1", "metadata": {"team": "a"}})]


def _post(http, route: str, extra: dict) -> httpx.Response:
    if route == "completions":
        return http.post("/v1/completions", json={"prompt": "12+34=", "max_tokens": 4, **extra})
    return http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "12+34"}], **extra})


@pytest.mark.parametrize("route,extra,param", REFUSED, ids=[case[2] for case in REFUSED])
def test_unsupported_fields_are_refused_by_name(http, route, extra, param):
    response = _post(http, route, extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


@pytest.mark.parametrize("route,extra", NO_OPS, ids=[case[0] for case in NO_OPS])
def test_fields_that_ask_for_nothing_are_accepted(http, route, extra):
    assert _post(http, route, extra).status_code == 200


def test_return_tokens_as_token_ids(client):
    extra = {"return_tokens_as_token_ids": True}
    result = client.completions.create(model=MODEL, prompt="12+34=", temperature=0, logprobs=1, extra_body=extra)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == ["token_id:8", "token_id:10", "token_id:2"]  # "4", "6", "</s>"
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    assert logprobs.text_offset == [0, 10, 21]  # offsets follow the strings returned
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12+34"}],
                                          logprobs=True, top_logprobs=1, extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["token_id:8", "token_id:10", "token_id:2"]
    assert content[0].bytes == list(b"token_id:8") and content[0].top_logprobs[0].token == "token_id:8"


def test_request_id_names_the_response_and_add_special_tokens(http):
    response = http.post("/v1/completions", json={"prompt": "12+34=", "request_id": "trace-42",
                                                  "add_special_tokens": False, "temperature": 0})
    assert response.json()["id"] == "cmpl-trace-42"
    assert response.json()["usage"]["prompt_tokens"] == 6  # no "<s>"
    twice = http.post("/v1/completions", json={"prompt": "1+1=", "request_id": "trace-42"})
    assert twice.status_code == 200  # engine ids stay unique


# ---- request volume -------------------------------------------------------------------------------------------
def test_request_volume_is_capped(http):
    many = http.post("/v1/completions", json={"prompt": ["1+1="] * 8, "n": 8, "max_tokens": 20, "temperature": 1})
    assert many.status_code == 400 and many.json()["error"]["param"] == "max_tokens"
    assert f"server.max_request_tokens={MAX_REQUEST_TOKENS}" in many.json()["error"]["message"]
    # The same n x max_tokens sent explicitly: n=40 x 27 (the context left after the 5 prompt tokens).
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+1"}], "n": 40,
                                                   "temperature": 1, "max_tokens": 27})
    assert chat.status_code == 400 and "max_request_tokens" in chat.json()["error"]["message"]
    body = {"prompt": ["1+1="] * 4, "n": 4, "max_tokens": 20, "temperature": 1}  # 320 tokens
    assert http.post("/v1/completions", json={**body, "logprobs": 5}).status_code == 200  # 320 x 6 entries
    logprobs = http.post("/v1/completions", json={**body, "logprobs": 6})  # 320 x 7 = 2240
    assert logprobs.status_code == 400 and logprobs.json()["error"]["param"] == "logprobs"
    assert f"server.max_request_logprobs={MAX_REQUEST_LOGPROBS}" in logprobs.json()["error"]["message"]


def test_volume_counts_the_whole_vocabulary_and_prompt_logprobs(http):
    """logprobs=-1 is vocab_size + 1 entries per token; prompt log-probs count (prompt tokens - 1) x
    (prompt_logprobs + 1), also when echo with logprobs turns them on."""
    def refused(body: dict, param: str) -> None:
        response = http.post("/v1/completions", json={"temperature": 1, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert f"server.max_request_logprobs={MAX_REQUEST_LOGPROBS}" in response.json()["error"]["message"]

    # 4 prompts x n=4 x 20 tokens x (16 + 1) = 5440 entries
    refused({"prompt": ["1+1="] * 4, "n": 4, "max_tokens": 20, "logprobs": -1}, "logprobs")
    long_prompts = [[1] + [5] * 29] * 8  # 8 x 29 scored prompt tokens
    refused({"prompt": long_prompts, "max_tokens": 1, "prompt_logprobs": -1}, "prompt_logprobs")  # 8 x 29 x 17
    refused({"prompt": long_prompts * 2, "max_tokens": 1, "echo": True, "logprobs": 4}, "logprobs")  # 16 x 29 x 5
    fits = http.post("/v1/completions", json={"prompt": long_prompts[:2], "max_tokens": 1, "prompt_logprobs": -1})
    assert fits.status_code == 200 and len(fits.json()["choices"][0]["prompt_logprobs"]) == 30


def test_implicit_max_tokens_is_lowered_to_fit(http):
    """Without max_tokens the request is not refused: its implicit max_tokens (a chat's: the 27 tokens
    left of the context) is lowered so the request fits the caps, and its choices end with "length"."""
    messages = [{"role": "user", "content": "1+1"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "n": 40, "temperature": 1,
                                                   "ignore_eos": True})  # 40 x 27 > 1000 tokens
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 40 * (MAX_REQUEST_TOKENS // 40)
    assert {c["finish_reason"] for c in chat.json()["choices"]} == {"length"}
    # 5 x 27 x (15 + 1) > 2000 logprob entries: 2000 // (5 x 16) = 25 tokens each
    top = http.post("/v1/chat/completions", json={"messages": messages, "n": 5, "temperature": 1, "ignore_eos": True,
                                                  "logprobs": True, "top_logprobs": 15})
    assert top.status_code == 200, top.text
    assert [len(c["logprobs"]["content"]) for c in top.json()["choices"]] == [MAX_REQUEST_LOGPROBS // (5 * 16)] * 5
    # A completion's implicit 16 too: 64 prompts x n=2 x 16 > 1000
    many = http.post("/v1/completions", json={"prompt": ["1+1="] * 64, "n": 2, "temperature": 1, "ignore_eos": True})
    assert many.status_code == 200 and many.json()["usage"]["completion_tokens"] == 128 * (MAX_REQUEST_TOKENS // 128)


# ---- routes -------------------------------------------------------------------------------------------------------
def test_model_card_and_model_route(live, http):
    card = http.get("/v1/models").json()["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"} <= set(card)
    assert card["id"] == MODEL and card["root"].endswith("tiny-adder") and card["parent"] is None
    permission = card["permission"][0]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert {k: permission[k] for k in ("allow_sampling", "allow_logprobs", "allow_fine_tuning", "organization",
                                       "group", "is_blocking")} == {
        "allow_sampling": True, "allow_logprobs": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False}
    assert http.get(f"/v1/models/{MODEL}").json() == card
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{live.url}/v1/models/{MODEL}").status_code == 401


def test_probes_are_open_and_head_health_works(live):
    assert httpx.head(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/ping").status_code == 200 and httpx.post(live.url + "/ping").status_code == 200
    assert httpx.get(live.url + "/version").json() == {"version": "0.1.0"}


def test_body_without_content_type_is_json(live):
    import socket

    payload = json.dumps({"prompt": "12+34=", "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and json.loads(data.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == "46"


def test_tokenize_and_detokenize(live, http):
    prompt = http.post("/tokenize", json={"prompt": "12+34=", "model": MODEL}).json()
    assert prompt == {"count": 7, "max_model_len": 32, "tokens": [1, 5, 6, 14, 7, 8, 15], "token_strs": None}
    bare = http.post("/tokenize", json={"prompt": "1+1", "add_special_tokens": False, "return_token_strs": True})
    assert bare.json()["tokens"] == [5, 14, 5] and bare.json()["token_strs"] == ["1", "+", "1"]
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "12+34"}]}).json()
    assert chat["tokens"] == [1, 5, 6, 14, 7, 8, 15]  # the template writes "<s>" and "="
    assert http.post("/detokenize", json={"tokens": [1, 5, 6, 14, 7, 8, 15]}).json() == {"prompt": "<s>12+34="}
    bad = http.post("/detokenize", json={"tokens": [1, 99]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = http.post("/tokenize", json={"prompt": "1", "tokens": [1]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tokens"
    too_long = http.post("/tokenize", json={"prompt": "1" * 200})
    assert too_long.status_code == 400 and "max_model_len=32" in too_long.json()["error"]["message"]
    assert httpx.post(live.url + "/tokenize", json={"prompt": "1"}).status_code == 401  # the key guards it


def test_api_key_from_the_environment(monkeypatch, tmp_path):
    from jaxserve.server.cli import _config_from_args

    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    assert _config_from_args([])[0].server.api_key == "from-env"
    assert _config_from_args(["--api-key", "from-flag"])[0].server.api_key == ("from-flag",)
    config_file = tmp_path / "keyed.yaml"
    config_file.write_text("server:\n  api_key: from-config\n")
    assert _config_from_args(["--config", str(config_file)])[0].server.api_key == "from-config"
    monkeypatch.setenv("JAXSERVE_API_KEY", "")
    assert _config_from_args([])[0].server.api_key is None
