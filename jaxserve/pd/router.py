"""`jaxserve router`: one OpenAI-compatible endpoint in front of prefill and decode instances.

    client -> POST /v1/completions | /v1/chat/completions (stream or not)
      pick a decode instance (fewest requests in flight from here, their prefill phase included; down ones
      skipped); with --local-prefill-max-tokens N, a prompt of at most N tokens (as that decode instance's
      /tokenize counts them) goes to it without a transfer and is prefilled there, beside its decode steps
      (conditional disaggregation: a short prefill costs the decode instance less than moving its KV); else a
      prefill instance (rendezvous hash of the prompt's start, for prefix-cache affinity,
      unless it is busier than the least loaded by more than AFFINITY_SLACK); sign kv_transfer_params
      {transfer_id, decode_address}
      -> prefill instance, stream=false: it computes the prompt and sends the KV (down or 5xx: another
         prefill instance; none left: the decode instance without a transfer, which prefills locally); its
         stop_reason
         "kv_transfer:<outcome>" says how the transfer ended
           refused (decode out of blocks) -> another decode instance, then waiting (backoff) until
                                             kv_transfer_timeout_s, then the least loaded one (it queues the
                                             request and prefills locally): never dropped
           unreachable                    -> that decode instance is marked down; another one
           sent | failed | timeout        -> the decode instance (failed or timed out: it re-prefills locally)
      -> decode instance, the client's request + kv_transfer_params: its response is relayed as it comes
           down before answering          -> marked down; retried on another decode instance (new transfer)
           down mid-stream                -> the stream ends with an error event (tokens were already sent)
      4xx from an instance (validation) is the client's answer as is; no instance left: 503 naming why

Instances are addressed by their HTTP URL; a decode instance's KV endpoint is read from its GET /pd/info.
The router forwards the client's Authorization header, so instances may share the router's API key.

The router's own surface is `jaxserve serve`'s where it can be: the same request guard in front of every
route (server.api_key, header and body limits; /health, /ping, /version and /metrics open), the same
request models validate a body before any instance sees it (400 naming the field), and /metrics uses the
server's metric names (TTFT and end-to-end latency as the router sees them) plus the router's own:
jaxserve:router_events{event} (transfer outcomes, retries, fallbacks, local prefills), jaxserve:router_instance_up and
jaxserve:router_in_flight{role, url}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from prometheus_client import Gauge
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.config import ServerConfig
from jaxserve.pd import protocol as proto
from jaxserve.pd.engine import OUTCOME_PREFIX
from jaxserve.server import protocol as P
from jaxserve.server.app import jaxserve_version
from jaxserve.server.errors import ApiError, error_body
from jaxserve.server.metrics import CONTENT_TYPE, PREFIX, ServerMetrics
from jaxserve.server.middleware import Guard
from jaxserve.server.serving import _validation_error

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 4  # requests in flight a prefill instance may exceed the least loaded one by and keep affinity
DOWN_S = 5.0  # a failed instance is skipped this long
_HOP_HEADERS = {"authorization"}
_MODELS = {"/v1/completions": P.CompletionRequest, "/v1/chat/completions": P.ChatCompletionRequest}
# The chat request's fields that /tokenize renders the same way
_CHAT_RENDERING = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                   "chat_template_kwargs", "add_special_tokens", "tools")


@dataclasses.dataclass
class Instance:
    url: str
    role: str
    in_flight: int = 0
    down_until: float = 0.0
    kv_address: str | None = None  # decode: from /pd/info

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self, why: str) -> None:
        logger.warning("router: %s instance %s is down for %.0f s: %s", self.role, self.url, DOWN_S, why)
        self.down_until = time.monotonic() + DOWN_S
        self.kv_address = None


class Router:
    def __init__(self, prefill: list[str], decode: list[str], token: str | None, *,
                 transfer_timeout_s: float = 10.0, request_timeout_s: float = 600.0, local_prefill_max_tokens: int = 0):
        if not prefill or not decode:
            raise ValueError("the router needs at least one --prefill and one --decode instance URL")
        if isinstance(local_prefill_max_tokens, bool) or not isinstance(local_prefill_max_tokens, int) \
                or local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be an integer >= 0 (0: every prompt goes through a "
                             f"prefill instance), got {local_prefill_max_tokens!r}")
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefill = [Instance(url.rstrip("/"), "prefill") for url in prefill]
        self.decode = [Instance(url.rstrip("/"), "decode") for url in decode]
        self.key = proto.derive_key(token)
        self.metrics = ServerMetrics("router")
        self.transfer_timeout_s = transfer_timeout_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self.counts: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # ---- choosing instances ----
    async def _kv_address(self, instance: Instance, headers: dict) -> str | None:
        if instance.kv_address is None:
            try:
                response = await self.client.get(instance.url + "/pd/info", headers=headers, timeout=5.0)
                info = response.json() if response.status_code == 200 else {}
            except (httpx.HTTPError, ValueError) as err:
                instance.mark_down(f"/pd/info: {err!r}")
                return None
            if info.get("role") != "decode" or not info.get("kv_transfer_address"):
                instance.mark_down(f"/pd/info answered {response.status_code} {info}: not a decode instance")
                return None
            instance.kv_address = info["kv_transfer_address"]
        return instance.kv_address

    async def pick_decode(self, exclude: set[str], headers: dict) -> Instance | None:
        for instance in sorted((d for d in self.decode if d.up and d.url not in exclude), key=lambda d: d.in_flight):
            # Counted while its KV address is looked up: a burst of requests before any address is known
            # spreads over the instances instead of all waiting for the first one's.
            instance.in_flight += 1
            try:
                address = await self._kv_address(instance, headers)
            finally:
                instance.in_flight -= 1
            if address is not None:
                return instance
        return None

    def pick_prefill(self, affinity: bytes, exclude: set[str]) -> Instance | None:
        candidates = [p for p in self.prefill if p.up and p.url not in exclude]
        if not candidates:
            return None
        least = min(p.in_flight for p in candidates)
        preferred = max(candidates, key=lambda p: hashlib.sha256(p.url.encode() + affinity).digest())
        return preferred if preferred.in_flight <= least + AFFINITY_SLACK else min(candidates,
                                                                                 key=lambda p: p.in_flight)

    async def prompt_tokens(self, decode: Instance, path: str, body: dict, headers: dict) -> int | None:
        """The request's prompt length in tokens as `decode` counts them (token ids as sent, else its
        /tokenize); None where it cannot tell (a batch of prompts, an instance that does not answer): such a
        request goes through a prefill instance."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            if not isinstance(prompt, str):
                return None
            query = {"prompt": prompt}
            if body.get("add_special_tokens") is not None:
                query["add_special_tokens"] = body["add_special_tokens"]
        else:
            query = {key: body[key] for key in _CHAT_RENDERING if body.get(key) is not None}
        try:
            response = await self.client.post(decode.url + "/tokenize", json=query, headers=headers, timeout=5.0)
            count = response.json().get("count") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return count if isinstance(count, int) else None

    # ---- one request ----
    async def handle(self, path: str, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as err:
            return _error(400, f"the request body is not valid UTF-8 JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, f"the request body must be a JSON object, got {type(body).__name__}")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is set by the router; leave it out", "kv_transfer_params")
        try:  # the server's own request models: a bad field is refused here, before any transfer
            _MODELS[path].model_validate(body)
        except ValidationError as err:
            invalid = _validation_error(err)
            return _error(invalid.status, invalid.message, invalid.param)
        response = await self._route(path, body, request)
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._timed(response.body_iterator, arrival)
        elif response.status_code == 200:
            self.metrics.e2e.observe(time.monotonic() - arrival)
        return response

    async def _timed(self, chunks: AsyncIterator[bytes], arrival: float) -> AsyncIterator[bytes]:
        first = True
        async for chunk in chunks:
            if first:
                self.metrics.ttft.observe(time.monotonic() - arrival)
                first = False
            yield chunk
        self.metrics.e2e.observe(time.monotonic() - arrival)

    async def _route(self, path: str, body: dict, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS}
        affinity = json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)[:512].encode()
        deadline = time.monotonic() + self.transfer_timeout_s
        refused: set[str] = set()
        failures: list[str] = []
        backoff = 0.02
        local = None  # the prompt is short enough to prefill on the decode instance (decided once)
        while True:
            decode = await self.pick_decode(refused, headers)
            if decode is not None and self.local_prefill_max_tokens and local is None:
                decode.in_flight += 1  # counted while it tokenizes, so a burst spreads over the instances
                try:
                    count = await self.prompt_tokens(decode, path, body, headers)
                finally:
                    decode.in_flight -= 1
                local = count is not None and count <= self.local_prefill_max_tokens
            if decode is not None and local:
                self._count("local_prefill")
                response = await self._decode(decode, path, body, None, headers, failures)
                if response is not None:
                    return response
                continue
            if decode is None and refused and time.monotonic() < deadline:
                await asyncio.sleep(backoff)  # every decode instance is out of blocks: wait for one
                backoff = min(backoff * 2, 0.5)
                refused.clear()
                continue
            if decode is None:
                if refused:  # still full past the deadline: queue on the least loaded, prefilled there
                    decode = min((d for d in self.decode if d.up), key=lambda d: d.in_flight, default=None)
                if decode is None:
                    self._count("no_decode")
                    return _error(503, "no decode instance is up" + (f" ({'; '.join(failures)})" if failures else "")
                                  + "; retry later", retry=True)
                return await self._decode(decode, path, body, None, headers, failures)
            params = self._params(decode)
            decode.in_flight += 1  # counts from the reservation on, so concurrent picks spread out
            try:
                outcome = await self._prefill(path, body, params, affinity, headers, failures)
            finally:
                decode.in_flight -= 1
            if isinstance(outcome, Response):
                return outcome
            if outcome is None:  # no prefill instance up: the decode instance prefills the prompt itself
                self._count("no_prefill")
                response = await self._decode(decode, path, body, None, headers, failures)
                if response is not None:
                    return response
                continue
            self._count(f"transfer_{outcome}")
            if outcome == "refused":
                refused.add(decode.url)
                continue
            if outcome == "unreachable":
                decode.mark_down("its KV endpoint is unreachable")
                failures.append(f"{decode.url}: KV endpoint unreachable")
                continue
            response = await self._decode(decode, path, body, params, headers, failures)
            if response is not None:
                return response

    def _params(self, decode: Instance) -> dict:
        transfer_id = proto.new_transfer_id()
        return {"transfer_id": transfer_id, "decode_address": decode.kv_address,
                "signature": proto.sign_params(self.key, transfer_id, decode.kv_address)}

    async def _prefill(self, path: str, body: dict, params: dict, affinity: bytes, headers: dict,
                       failures: list[str]) -> str | Response | None:
        """The transfer's outcome, the response to give the client (a 4xx), or None when no prefill instance
        could take the request."""
        prefill_body = {**body, "stream": False, "kv_transfer_params": params, "max_tokens": 1}
        for key in ("stream_options", "max_completion_tokens", "logprobs", "top_logprobs"):
            prefill_body.pop(key, None)
        tried: set[str] = set()
        while (prefill := self.pick_prefill(affinity, tried)) is not None:
            tried.add(prefill.url)
            prefill.in_flight += 1
            try:
                response = await self.client.post(prefill.url + path, json=prefill_body, headers=headers)
            except httpx.HTTPError as err:
                prefill.mark_down(repr(err))
                failures.append(f"{prefill.url}: {err!r}")
                continue
            finally:
                prefill.in_flight -= 1
            if 400 <= response.status_code < 500:
                return Response(response.content, response.status_code, media_type="application/json")
            if response.status_code != 200:
                if response.status_code != 429:
                    prefill.mark_down(f"answered {response.status_code}")
                failures.append(f"{prefill.url}: {response.status_code}")
                continue
            choices = response.json().get("choices") or [{}]
            reason = str(choices[0].get("stop_reason") or "")
            return reason[len(OUTCOME_PREFIX):] if reason.startswith(OUTCOME_PREFIX) else "failed"
        return None

    async def _decode(self, decode: Instance, path: str, body: dict, params: dict | None, headers: dict,
                      failures: list[str]) -> Response | None:
        """The decode instance's response relayed, or None when it was down before answering (retry)."""
        decode_body = {**body, "kv_transfer_params": params} if params is not None else body
        decode.in_flight += 1
        try:
            upstream = await self.client.send(self.client.build_request("POST", decode.url + path, json=decode_body,
                                                                        headers=headers), stream=True)
        except httpx.HTTPError as err:
            decode.in_flight -= 1
            decode.mark_down(repr(err))
            failures.append(f"{decode.url}: {err!r}")
            return None
        if not body.get("stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as err:
                decode.mark_down(repr(err))
                failures.append(f"{decode.url}: {err!r}")
                return None
            finally:
                decode.in_flight -= 1
                await upstream.aclose()
            if upstream.status_code >= 500 and upstream.status_code != 503:
                decode.mark_down(f"answered {upstream.status_code}")
            self._count(f"decode_{upstream.status_code}")
            return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
        self._count(f"decode_{upstream.status_code}")
        return StreamingResponse(self._relay(decode, upstream), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    async def _relay(self, decode: Instance, upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as err:
            decode.mark_down(repr(err))
            self._count("decode_lost_mid_stream")
            message = f"the decode instance failed mid-stream ({err!r}); the output is incomplete, retry"
            yield f"data: {error_body(502, message)}\n\ndata: [DONE]\n\n".encode()
        finally:
            decode.in_flight -= 1
            await upstream.aclose()


def _error(status: int, message: str, param: str | None = None, retry: bool = False) -> Response:
    return Response(error_body(status, message, param), status_code=status, media_type="application/json",
                    headers={"Retry-After": "1"} if retry else None)


def build_router_app(router: Router, config: ServerConfig | None = None) -> FastAPI:
    """The router's app behind the server's request guard (`config`: its api_key and limits)."""
    app = FastAPI(title="jaxserve router")
    app.state.router = router
    registry = router.metrics.registry
    events = Gauge(PREFIX + "router_events", "Router events since start: transfer outcomes (transfer_*), "
                   "decode answers (decode_<status>), fallbacks.", ["event"], registry=registry)
    up = Gauge(PREFIX + "router_instance_up", "1 when the instance is in use, 0 while marked down.",
               ["role", "url"], registry=registry)
    in_flight = Gauge(PREFIX + "router_in_flight", "Requests in flight from this router per instance.",
                      ["role", "url"], registry=registry)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> Response:
        return _error(err.status, err.message, err.param)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for instance in router.decode:
            try:
                response = await router.client.get(instance.url + "/v1/models", headers={
                    k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS})
            except httpx.HTTPError:
                continue
            return Response(response.content, response.status_code, media_type="application/json")
        return _error(503, "no decode instance answers", retry=True)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not any(d.up for d in router.decode):
            return _error(503, "no decode instance is up", retry=True)
        return JSONResponse({})  # without a prefill instance up the decode instances prefill themselves

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": jaxserve_version()})

    @app.get("/metrics")
    async def metrics() -> Response:
        for event, count in list(router.counts.items()):
            events.labels(event).set(count)
        for instance in router.prefill + router.decode:
            up.labels(instance.role, instance.url).set(int(instance.up))
            in_flight.labels(instance.role, instance.url).set(instance.in_flight)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/router/state")
    async def state() -> Response:
        return JSONResponse({"counts": router.counts, "instances": [
            {"url": i.url, "role": i.role, "up": i.up, "in_flight": i.in_flight, "kv_address": i.kv_address}
            for i in router.prefill + router.decode]})

    app.add_middleware(Guard, config=config or ServerConfig())
    return app


def main(argv: list[str]) -> int:
    """`jaxserve router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...] --port N`."""
    import argparse
    import sys

    import uvicorn
    import yaml

    from jaxserve.config import load_config

    parser = argparse.ArgumentParser(prog="jaxserve router", description="one OpenAI endpoint over prefill and "
                                     "decode instances (README: Prefill/decode disaggregation)")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill instance (repeatable)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode instance (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", type=str, help="YAML config whose server section gives kv_transfer_token, "
                        "kv_transfer_timeout_s, api_key (the instances' own) and pd_local_prefill_max_tokens")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                        help="prompts of at most N tokens are prefilled on the decode instance, without a KV "
                        "transfer (default: the config's server.pd_local_prefill_max_tokens, 0: every prompt goes "
                        "through a prefill instance)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    try:
        server = load_config(args.config).server if args.config else load_config(None).server
        router = Router(args.prefill, args.decode, server.kv_transfer_token,
                        transfer_timeout_s=server.kv_transfer_timeout_s,
                        local_prefill_max_tokens=server.pd_local_prefill_max_tokens
                        if args.local_prefill_max_tokens is None else args.local_prefill_max_tokens)
    except (ValueError, TypeError, FileNotFoundError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logger.info("routing http://%s:%d over %d prefill and %d decode instances", args.host, args.port,
                len(router.prefill), len(router.decode))
    uvicorn.run(build_router_app(router, server), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0
