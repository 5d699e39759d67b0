"""The router's choices against fake instances (httpx mock transport, no processes): a decode instance out
of blocks sends the request elsewhere; all of them out of blocks makes it wait, then queue on the least
loaded one without a transfer (never dropped); a decode instance gone before answering is retried on
another; a prefill instance's 4xx is the client's answer; a burst of requests while the decode instances'
KV addresses are still being asked for spreads over them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.requests import Request

from jaxserve.pd.router import Router

DECODES = {"http://d1": "127.0.0.1:7001", "http://d2": "127.0.0.1:7002"}


def _router(handler, timeout_s: float = 0.3) -> Router:
    router = Router(["http://p1"], list(DECODES), None, transfer_timeout_s=timeout_s)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router


def _request(body: dict) -> Request:
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


def _run(router: Router, body: dict) -> tuple[int, dict]:
    async def go():
        response = await router.handle("/v1/completions", _request(body))
        return response.status_code, json.loads(response.body)
    return asyncio.run(go())


def _handler(refusing: set[str], calls: list, dead: set[str] = frozenset()):
    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if request.url.path == "/pd/info":
            return httpx.Response(200, json={"role": "decode", "kv_transfer_address": DECODES[url]})
        body = json.loads(request.content)
        params = body.get("kv_transfer_params")
        calls.append((url, params and params["decode_address"]))
        if url == "http://p1":
            address = params["decode_address"]
            outcome = "refused" if address in refusing else "sent"
            return httpx.Response(200, json={"choices": [{"text": "x", "stop_reason": f"kv_transfer:{outcome}"}]})
        if url in dead:
            raise httpx.RemoteProtocolError("server disconnected")
        return httpx.Response(200, json={"choices": [{"text": f"from {url}"}]})
    return handler


def test_refused_decode_routes_elsewhere():
    calls = []
    router = _router(_handler({DECODES["http://d1"]}, calls))
    status, body = _run(router, {"prompt": "1+1="})
    assert status == 200 and body["choices"][0]["text"] == "from http://d2"
    assert router.counts["transfer_refused"] == 1 and router.counts["transfer_sent"] == 1


def test_all_refused_waits_then_queues_without_a_transfer():
    calls = []
    router = _router(_handler(set(DECODES.values()), calls))
    status, body = _run(router, {"prompt": "1+1="})
    assert status == 200 and body["choices"][0]["text"].startswith("from http://d")
    assert router.counts["transfer_refused"] > 2  # it kept trying while waiting
    assert calls[-1][1] is None  # the final decode request carries no transfer: prefilled there


def test_decode_gone_before_answering_is_retried_on_another():
    calls = []
    router = _router(_handler(set(), calls, dead={"http://d1"}))
    status, body = _run(router, {"prompt": "1+1="})
    assert status == 200 and body["choices"][0]["text"] == "from http://d2"
    assert not router.decode[0].up


def test_prefill_validation_error_is_the_clients_answer():
    def handler(request):
        if request.url.path == "/pd/info":
            return httpx.Response(200, json={"role": "decode", "kv_transfer_address": "127.0.0.1:7001"})
        return httpx.Response(400, json={"error": {"message": "max_tokens: bad", "param": "max_tokens"}})
    router = _router(handler)
    status, body = _run(router, {"prompt": "1+1=", "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def _app_client(handler, api_key: str | None = None) -> tuple[Router, httpx.AsyncClient]:
    from jaxserve.config import ServerConfig
    from jaxserve.pd.router import build_router_app
    router = _router(handler)
    app = build_router_app(router, ServerConfig(api_key=api_key))
    return router, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def test_router_has_the_servers_guard_validation_health_and_metrics():
    calls = []

    async def go():
        router, client = _app_client(_handler(set(), calls), api_key="secret")
        async with client:
            key = {"Authorization": "Bearer secret"}
            assert (await client.post("/v1/completions", json={"prompt": "1+1="})).status_code == 401
            assert (await client.get("/health")).status_code == 200  # probes need no key, as in `serve`
            bad = await client.post("/v1/completions", json={"prompt": "1+1=", "n": 10**6}, headers=key)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
            unsupported = await client.post("/v1/chat/completions", headers=key, json={
                "messages": [{"role": "user", "content": "1+1="}], "use_beam_search": True})
            assert unsupported.status_code == 400 and "use_beam_search" in unsupported.text
            assert calls == []  # refused before any instance saw them
            ok = await client.post("/v1/completions", json={"prompt": "1+1="}, headers=key)
            assert ok.status_code == 200 and calls[0][0] == "http://p1"
            metrics = (await client.get("/metrics")).text
            assert 'jaxserve:router_events{event="transfer_sent"} 1.0' in metrics
            assert 'jaxserve:router_instance_up{role="decode",url="http://d1"} 1.0' in metrics
            assert "jaxserve:e2e_request_latency_seconds_count" in metrics
            for instance in router.decode:
                instance.mark_down("test")
            assert (await client.get("/health")).status_code == 503
    asyncio.run(go())


def test_a_burst_before_any_kv_address_is_known_spreads_over_the_decode_instances():
    """Concurrent requests arriving while the router still asks the decode instances for their KV addresses
    (/pd/info answers slowly) go to both instances, not all to the first one's."""
    async def go():
        async def slow_info(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/pd/info":
                await asyncio.sleep(0.05)
            return _handler(set(), calls)(request)

        router = Router(["http://p1"], list(DECODES), None, transfer_timeout_s=0.3)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(slow_info))
        return await asyncio.gather(*(router.pick_decode(set(), {}) for _ in range(8)))

    calls = []
    picked = asyncio.run(go())
    assert {instance.url for instance in picked} == set(DECODES)
    assert all(instance.in_flight == 0 for instance in picked)  # (the caller counts its request itself)


def _counting_handler(calls: list, tokenize_status: int = 200):
    """_handler's instances, whose /tokenize counts a prompt's characters as its tokens (a chat: the
    characters of its messages' contents) and records what it was asked."""
    inner = _handler(set(), calls)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            query = json.loads(request.content)
            calls.append(("tokenize", query))
            if tokenize_status != 200:
                return httpx.Response(tokenize_status, json={"error": {"message": "busy"}})
            text = query.get("prompt") or "".join(m["content"] for m in query["messages"])
            return httpx.Response(200, json={"count": len(text), "max_model_len": 32, "tokens": []})
        return inner(request)
    return handler


def _local_router(handler, max_tokens: int = 6) -> Router:
    router = Router(["http://p1"], list(DECODES), None, transfer_timeout_s=0.3, local_prefill_max_tokens=max_tokens)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router


def test_short_prompts_prefill_on_the_decode_instance_long_ones_go_through_a_prefill_instance():
    calls = []
    router = _local_router(_counting_handler(calls))
    status, body = _run(router, {"prompt": "1+1=", "add_special_tokens": False})  # 4 tokens <= 6
    assert status == 200 and body["choices"][0]["text"].startswith("from http://d")
    assert calls[0] == ("tokenize", {"prompt": "1+1=", "add_special_tokens": False})
    assert [c for c in calls[1:] if c[0] == "http://p1"] == [] and calls[-1][1] is None  # no transfer
    assert router.counts["local_prefill"] == 1 and "transfer_sent" not in router.counts

    calls.clear()
    status, _ = _run(router, {"prompt": "1234+5678="})  # 10 tokens > 6
    assert status == 200 and calls[0] == ("tokenize", {"prompt": "1234+5678="})
    assert calls[1][0] == "http://p1" and calls[2][1] is not None  # prefilled there, its KV sent
    assert router.counts["transfer_sent"] == 1 and router.counts["local_prefill"] == 1


def test_local_prefill_counts_token_ids_itself_renders_chats_and_falls_back_to_a_transfer():
    def routed(body: dict, path: str = "/v1/completions", tokenize_status: int = 200) -> tuple[list, dict]:
        """(the instances' calls, the router's counts) for one request."""
        calls = []
        router = _local_router(_counting_handler(calls, tokenize_status))
        assert asyncio.run(router.handle(path, _request(body))).status_code == 200
        return calls, router.counts

    calls, counts = routed({"prompt": [5, 6, 7]})  # token ids: counted without asking
    assert calls[0][0] != "tokenize" and counts["local_prefill"] == 1
    calls, counts = routed({"prompt": [[5, 6, 7, 8, 9, 10, 11]]})  # a batch of one, 7 ids > 6
    assert calls[0][0] == "http://p1" and counts["transfer_sent"] == 1 and "local_prefill" not in counts

    chat = {"messages": [{"role": "user", "content": "1+1="}], "add_generation_prompt": False}
    calls, counts = routed(chat, "/v1/chat/completions")  # rendered by /tokenize with the request's fields
    assert calls[0] == ("tokenize", chat) and counts["local_prefill"] == 1

    calls, counts = routed({"prompt": ["1+1=", "2+2="]})  # a batch of prompts: through a prefill instance
    assert calls[0][0] == "http://p1" and counts["transfer_sent"] == 1

    calls, counts = routed({"prompt": "1+1="}, tokenize_status=503)  # /tokenize failed: the usual transfer
    assert calls[1][0] == "http://p1" and counts["transfer_sent"] == 1 and "local_prefill" not in counts


def test_local_prefill_max_tokens_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="--local-prefill-max-tokens must be an integer >= 0"):
            Router(["http://p1"], ["http://d1"], None, local_prefill_max_tokens=bad)


def test_a_burst_of_short_prompts_spreads_over_the_decode_instances_while_they_tokenize():
    async def go():
        inner = _counting_handler(calls)

        async def slow_tokenize(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/tokenize":
                await asyncio.sleep(0.05)
            return inner(request)

        router = _local_router(slow_tokenize)
        responses = await asyncio.gather(*(router.handle("/v1/completions", _request({"prompt": "1+1="}))
                                           for _ in range(8)))
        return router, [json.loads(r.body)["choices"][0]["text"] for r in responses]

    calls = []
    router, texts = asyncio.run(go())
    assert set(texts) == {f"from {url}" for url in DECODES} and router.counts["local_prefill"] == 8


def test_the_routers_local_prefill_limit_comes_from_its_flag_else_the_config(monkeypatch, tmp_path, capsys):
    import uvicorn

    from jaxserve.pd import router as router_module
    built = []
    monkeypatch.setattr(router_module, "build_router_app", lambda router, config: built.append(router))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    config = tmp_path / "pd.yaml"
    config.write_text("server:\n  pd_local_prefill_max_tokens: 256\n")
    urls = ["--prefill", "http://p1", "--decode", "http://d1"]
    assert router_module.main([*urls, "--config", str(config)]) == 0
    assert router_module.main([*urls, "--config", str(config), "--local-prefill-max-tokens", "64"]) == 0
    assert router_module.main(urls) == 0
    assert [r.local_prefill_max_tokens for r in built] == [256, 64, 0]
    assert router_module.main([*urls, "--local-prefill-max-tokens", "-1"]) == 2
    assert "--local-prefill-max-tokens must be an integer >= 0" in capsys.readouterr().err
    config.write_text("server:\n  pd_local_prefill_max_tokens: -5\n")
    assert router_module.main([*urls, "--config", str(config)]) == 2
    assert "server.pd_local_prefill_max_tokens must be >= 0" in capsys.readouterr().err
