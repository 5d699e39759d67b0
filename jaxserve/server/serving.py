"""The OpenAI routes' logic: HTTP request -> engine requests -> JSON response or SSE stream.

    body --parse (400)--> model (404) --> admission pre-check (429 / 503, before any tokenizing)
    --> prompt bound (400: more characters than max_model_len tokens can hold, nothing tokenized)
    --tokenizer worker processes (tokenizer_pool.py)--> chat template + token ids
    --thread pool--> engine.prepare_request (ValueError -> 400 naming the param) --> request volume (400)
    --> bridge.submit (429 / 503) --> RequestGroup
        stream=false: wait for the final outputs, racing the client's disconnect (then abort)
        stream=true:  streaming.py's SSE chunks and `data: [DONE]`; the response aborts whatever is
                      unfinished when it ends for any reason (client gone included)

Choice i of prompt p is choice `p * n + i` of the response. Outputs are cumulative, so a delta is the
text / token ids past what was already sent: nothing is lost or sent twice however outputs coalesce.
/tokenize and /detokenize (vLLM's shapes) go through the same workers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxserve.config import ServerConfig
from jaxserve.engine_client import EngineClient, PreparedRequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server import logprobs_format
from jaxserve.server import protocol as P
from jaxserve.server import streaming
from jaxserve.server.bridge import EngineBridge, RequestGroup
from jaxserve.server.errors import ApiError, param_of
from jaxserve.server.tokenizer_pool import Encoded, TokenizeError, TokenizerPool
from jaxserve.tokenizer import SPECIAL_TOKEN_NAMES

_DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_KNOWN_PARAMS = (set(P.ChatCompletionRequest.model_fields) | set(P.CompletionRequest.model_fields)
                 | {"prompt_token_ids", "stop_token_ids"} | set(P.UNSUPPORTED))
_INLINE_PARSE_BYTES = 64 << 10  # larger bodies are decoded in the thread pool
_JSON_MEDIA_TYPE = re.compile(r"^application/([a-z0-9.+-]+\+)?json$")


class _EventStream(StreamingResponse):
    """SSE response that aborts its requests' unfinished work however the response ends."""

    def __init__(self, chunks: AsyncIterator[str], group: RequestGroup):
        super().__init__(chunks, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()


_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class Serving:
    def __init__(self, engine: EngineClient, bridge: EngineBridge, config: ServerConfig,
                 model_name: str, tokens: TokenizerPool | None):
        self.engine = engine
        self.bridge = bridge
        self.config = config
        self.model_name = model_name
        self.tokens = tokens  # None: no tokenizer (model.skip_tokenizer_init); token-id prompts only
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="jaxserve-prepare")
        self._large_body = asyncio.Semaphore(1)
        self.defaults = {k: v for k, v in engine.sampling_defaults.items() if k in _DEFAULT_SAMPLING_KEYS}
        # Template variables a request may not set: the renderer's own arguments and the special tokens.
        tokenizer = engine.tokenizer
        self._reserved_template_kwargs = (set() if tokenizer is None else
                                          set(inspect.signature(tokenizer.apply_chat_template).parameters)
                                          | set(SPECIAL_TOKEN_NAMES) | set(tokenizer.special_tokens_map))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- request handling common to the routes ----
    async def _parse(self, request: Request, model_cls: type[BaseModel] | Callable[[dict], type[BaseModel]]) -> Any:
        """The validated body; `model_cls` may choose the model from the JSON object. A large body is decoded
        in the thread pool, so the event loop keeps serving while it is (other streams, /health)."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type and not _JSON_MEDIA_TYPE.match(media_type):  # no Content-Type: JSON, as vLLM reads it
            raise ApiError(400, f"Content-Type must be application/json (or left out), got {media_type!r}")
        raw = await request.body()
        if len(raw) <= _INLINE_PARSE_BYTES:
            return self._decode(raw, model_cls)
        # One large body at a time: decoding holds the GIL, and the engine thread must keep getting it.
        async with self._large_body:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._decode, raw, model_cls)

    def _decode(self, raw: bytes, model_cls: type[BaseModel] | Callable[[dict], type[BaseModel]]) -> Any:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ApiError(400, f"the request body is not valid UTF-8 JSON: {err}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        if not isinstance(model_cls, type):
            model_cls = model_cls(data)
        try:
            body = model_cls.model_validate(data)
        except ValidationError as err:
            raise _validation_error(err) from None
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist.", "model")
        return body

    def _sampling_params(self, body: P.OpenAIRequest) -> SamplingParams:
        try:
            return body.sampling_params(self.defaults)
        except ValueError as err:
            raise ApiError(400, str(err), param_of(str(err), _KNOWN_PARAMS)) from None

    def _entries_per_token(self, num_logprobs: int | None) -> int:
        """Logprob entries of one scored token for logprobs / prompt_logprobs = `num_logprobs`: the chosen
        token and the top-N (-1: the whole vocabulary); 0 when off."""
        if num_logprobs is None:
            return 0
        return (self.engine.vocab_size if num_logprobs == -1 else num_logprobs) + 1

    def _prompt_entries(self, prepared: list[PreparedRequest], params: SamplingParams, copies: int) -> int:
        """Prompt log-prob entries of a request: every prompt token but the first is scored, and the
        response carries them `copies` times (each /v1/completions choice has its prompt's)."""
        per_token = self._entries_per_token(params.prompt_logprobs)
        return copies * per_token * sum(len(p.prompt_token_ids) - 1 for p in prepared)

    def _check_volume(self, num_prompts: int, max_tokens: int, params: SamplingParams, prompt_entries: int = 0,
                      prompt_param: str = "prompt_logprobs") -> None:
        """Refuse a request whose generated tokens (prompts x n x max_tokens, `max_tokens` summed over its
        prompts) or logprob entries (that x (logprobs + 1), plus `prompt_entries`) pass the server's caps."""
        config = self.config
        tokens = max_tokens * params.n
        shape = f"{num_prompts} prompt(s) x n={params.n} x max_tokens"
        if tokens > config.max_request_tokens:
            raise ApiError(400, f"the request may generate {tokens} tokens ({shape}), more than "
                                f"server.max_request_tokens={config.max_request_tokens}; lower n, max_tokens or the "
                                f"number of prompts", "max_tokens")
        per_token = self._entries_per_token(params.logprobs)
        entries = tokens * per_token + prompt_entries
        if entries <= config.max_request_logprobs:
            return
        parts = []
        if per_token:
            parts.append(f"{tokens * per_token} for the generated tokens ({shape} x (logprobs={params.logprobs}"
                         f"{' (the whole vocabulary)' if params.logprobs == -1 else ''} + 1))")
        if prompt_entries:
            parts.append(f"{prompt_entries} for the prompt tokens ((prompt tokens - 1) x (prompt_logprobs="
                         f"{params.prompt_logprobs}{' (the whole vocabulary)' if params.prompt_logprobs == -1 else ''}"
                         f" + 1))")
        param = prompt_param if prompt_entries > config.max_request_logprobs or not per_token else "logprobs"
        raise ApiError(400, f"the request may return {entries} logprob entries ({' + '.join(parts)}), more than "
                            f"server.max_request_logprobs={config.max_request_logprobs}; lower {param}, n, "
                            f"max_tokens or the prompts", param)

    def _fit_implicit_max_tokens(self, prepared: list[PreparedRequest], params: SamplingParams,
                                 prompt_entries: int) -> None:
        """max_tokens not sent: lower each prompt's implicit max_tokens (the context left, or completions'
        16) so the request fits the caps; those prompts end with finish_reason "length" there. Only a
        request that passes them even at max(1, min_tokens) tokens per sequence is refused."""
        config = self.config
        sequences = len(prepared) * params.n
        limit = config.max_request_tokens // sequences
        per_token = self._entries_per_token(params.logprobs)
        if per_token:
            limit = min(limit, (config.max_request_logprobs - prompt_entries) // (sequences * per_token))
        limit = max(limit, 1, params.min_tokens)  # past the caps even so: _check_volume refuses it
        for p in prepared:
            p.max_tokens = min(p.max_tokens, limit)

    def _check_prompt_chars(self, text: str, param: str) -> None:
        limit = self.tokens.max_prompt_chars if self.tokens is not None else None
        if limit is not None and len(text) > limit:
            raise ApiError(400, f"{param} is {len(text)} characters, more than max_model_len="
                                f"{self.engine.max_model_len} tokens of at most {self.tokens.max_chars_per_token} "
                                f"characters each can hold ({limit}); shorten it", param)

    def _checked(self, encoded: Encoded, param: str) -> list[int]:
        if encoded.token_ids is None:
            raise ApiError(400, f"The prompt (length {encoded.count}) is longer than the maximum model length of "
                                f"{self.engine.max_model_len} minus one generated token; shorten the prompt", param)
        return encoded.token_ids

    async def _prepare(self, items: list[dict], params: SamplingParams, body: P.OpenAIRequest, request: Request,
                       request_id: str, param: str, implicit_max_tokens: bool) -> list[PreparedRequest]:
        """engine.prepare_request for each tokenized prompt, in the thread pool; then the volume check
        (`implicit_max_tokens`: the client sent none, so it is lowered to fit instead of refused)."""
        tenant = request.scope.get("jaxserve.tenant")

        def work() -> list[PreparedRequest]:
            try:
                prepared = [self.engine.prepare_request(item, params, request_id=f"{request_id}-{i}",
                                                        priority=body.priority, cache_salt=body.cache_salt,
                                                        tenant=tenant, strict=True)  # max_tokens past the context: 400
                            for i, item in enumerate(items)]
                if body.kv_transfer_params is not None:  # a PD instance's (jaxserve/pd/engine.py)
                    accept = getattr(self.engine, "accept_kv_transfer_params", None)
                    if accept is None:
                        raise ValueError("kv_transfer_params is only accepted by a prefill or decode instance "
                                         "(server.pd_role) behind `jaxserve router`; leave it out")
                    for i, p in enumerate(prepared):
                        accept(p, body.kv_transfer_params, i)
                return prepared
            except ValueError as err:
                message = str(err)
                found = param_of(message, _KNOWN_PARAMS) or param
                raise ApiError(400, message, "prompt" if found == "prompt_token_ids" else found) from None

        prepared = await asyncio.get_running_loop().run_in_executor(self.pool, work)
        # Each /v1/completions choice carries its prompt's log-probs; a chat response carries them once.
        copies = params.n if param == "prompt" else 1
        prompt_entries = self._prompt_entries(prepared, params, copies)
        if implicit_max_tokens:
            self._fit_implicit_max_tokens(prepared, params, prompt_entries)
        self._check_volume(len(prepared), sum(p.max_tokens for p in prepared), params, prompt_entries,
                           "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs")
        return prepared

    async def _encode(self, prompt: str | list[int], add_special_tokens: bool) -> dict:
        """One engine prompt: {"prompt", "prompt_token_ids"} tokenized by a worker, or the ids sent."""
        if isinstance(prompt, list):
            return {"prompt_token_ids": prompt}
        if self.tokens is None:
            return {"prompt": prompt}  # refused by the engine: it has no tokenizer
        self._check_prompt_chars(prompt, "prompt")
        encoded = await self._tokenizing("prompt", self.tokens.encode(prompt, add_special_tokens))
        return {"prompt": prompt, "prompt_token_ids": self._checked(encoded, "prompt")}

    async def _collect(self, request: Request, group: RequestGroup) -> dict[int, RequestOutput] | None:
        """The final outputs by prompt index, or None when the client went away first (work aborted)."""
        latest: dict[int, RequestOutput] = {}

        async def consume():
            async for updates in group:
                latest.update(updates)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            consumer.cancel()
            group.abort()
        if consumer not in done:
            return None
        consumer.result()  # re-raises an engine failure
        return latest

    def _stream_spec(self, body: P.OpenAIRequest, response_id: str, n: int,
                     prepared: list[PreparedRequest]) -> streaming.StreamSpec:
        return streaming.StreamSpec(response_id, self.model_name, n, [len(p.prompt_token_ids) for p in prepared],
                                    body.include_usage, body.continuous_usage, body.return_tokens_as_token_ids)

    @staticmethod
    def _ids(prefix: str, body: P.OpenAIRequest) -> tuple[str, str]:
        """(the response id, the engine requests' id prefix); engine ids stay unique whatever request_id says."""
        internal = f"{prefix}-{uuid.uuid4().hex}"
        return (f"{prefix}-{body.request_id}" if body.request_id else internal), internal

    # ---- /v1/completions ----
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, P.CompletionRequest)
        prompts = body.prompts()
        self.bridge.check_admission(len(prompts))
        params = self._sampling_params(body)
        if body.max_tokens is not None:  # before any tokenizing; else the implicit 16 is lowered to fit
            self._check_volume(len(prompts), len(prompts) * params.max_tokens, params)
        add_special = body.add_special_tokens if body.add_special_tokens is not None else True
        items = await asyncio.gather(*(self._encode(p if isinstance(p, str) else p["prompt_token_ids"], add_special)
                                       for p in prompts))
        response_id, internal_id = self._ids("cmpl", body)
        prepared = await self._prepare(list(items), params, body, request, internal_id, "prompt",
                                       implicit_max_tokens=body.max_tokens is None)
        echoes = list(await asyncio.gather(*(self._echo_text(p) for p in prepared))) if body.echo else None
        group = self.bridge.submit(prepared)
        if body.stream:
            spec = self._stream_spec(body, response_id, params.n, prepared)
            return _EventStream(streaming.completion_stream(spec, group, echoes), group)
        outputs = await self._collect(request, group)
        if outputs is None:
            return Response(status_code=499)
        choices = []
        as_ids = body.return_tokens_as_token_ids
        for prompt_index, output in sorted(outputs.items()):
            prompt_logprobs = logprobs_format.prompt_logprobs_json(output.prompt_logprobs)
            echo = echoes[prompt_index] if echoes is not None else ""
            for c in output.outputs:
                if body.echo:
                    text, logprobs = logprobs_format.echo_choice(echo, output, c, body.max_tokens, body.logprobs,
                                                                 self.engine.tokenizer)
                else:
                    text = c.text
                    logprobs = (streaming.completion_logprobs(c.logprobs, 0, as_ids)[0]
                                if c.logprobs is not None else None)
                choices.append(P.CompletionChoice(index=prompt_index * params.n + c.index, text=text,
                                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs))
        return _json(P.CompletionResponse(id=response_id, created=int(time.time()), model=self.model_name,
                                          choices=choices, usage=streaming.usage_of(outputs)))

    async def _tokenizing(self, param: str, call):
        """Await a tokenizer-worker call; its failure is the request's error, naming `param`."""
        try:
            return await call
        except TokenizeError as err:
            raise _tokenize_error(err, param, self.config.retry_after_s) from None

    async def _echo_text(self, prepared: PreparedRequest) -> str:
        if prepared.prompt is not None or self.tokens is None:
            return prepared.prompt or ""
        return await self._tokenizing("prompt",
                                      self.tokens.decode(prepared.prompt_token_ids, skip_special_tokens=False))

    # ---- /v1/chat/completions ----
    async def _render(self, body: P.ChatCompletionRequest | P.TokenizeChatRequest) -> dict[str, Any]:
        """Check a chat's template options; the arguments of TokenizerPool.render_chat / tokenize_body."""
        if self.tokens is None:
            raise ApiError(400, "this server runs without a tokenizer (model.skip_tokenizer_init), so it cannot "
                                "render chats; send token ids to /v1/completions", "messages")
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise ApiError(400, "chat_template in a request is refused: the server does not set "
                                "server.trust_request_chat_template", "chat_template")
        kwargs = body.chat_template_kwargs or {}
        clashing = sorted(set(kwargs) & self._reserved_template_kwargs)
        if clashing:
            raise ApiError(400, f"chat_template_kwargs may not set {clashing}: the server sets them (use the request "
                                "fields such as add_generation_prompt instead)", "chat_template_kwargs")
        try:
            messages = [m.template_dict(i) for i, m in enumerate(body.messages)]
        except ValueError as err:
            raise ApiError(400, str(err), "messages") from None
        return {"messages": messages, "add_generation_prompt": body.add_generation_prompt,
                "continue_final_message": body.continue_final_message, "chat_template": body.chat_template,
                "tools": P.tool_dicts(body.tools), "template_kwargs": kwargs}

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, P.ChatCompletionRequest)
        chat = await self._render(body)
        self.bridge.check_admission(1)
        params = self._sampling_params(body)
        if params.max_tokens is not None:
            self._check_volume(1, params.max_tokens, params)  # before any tokenizing
        encoded = await self._tokenizing(
            "messages", self.tokens.render_chat(**chat, add_special_tokens=bool(body.add_special_tokens)))
        item = {"prompt": encoded.prompt, "prompt_token_ids": self._checked(encoded, "messages")}
        response_id, internal_id = self._ids("chatcmpl", body)
        prepared = await self._prepare([item], params, body, request, internal_id, "messages",
                                       implicit_max_tokens=params.max_tokens is None)
        group = self.bridge.submit(prepared)
        top_n = body.top_logprobs or 0
        if body.stream:
            spec = self._stream_spec(body, response_id, params.n, prepared)
            return _EventStream(streaming.chat_stream(spec, group, top_n, body.response_role, body.echoed_text()),
                                group)
        outputs = await self._collect(request, group)
        if outputs is None:
            return Response(status_code=499)
        as_ids = body.return_tokens_as_token_ids
        role, echoed = body.response_role, body.echoed_text()
        choices = [P.ChatChoice(index=c.index, message=P.ChatMessageOut(role=role, content=echoed + c.text),
                                logprobs=(streaming.chat_logprobs(c.logprobs, top_n, as_ids)
                                          if c.logprobs is not None else None),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in outputs[0].outputs]
        return _json(P.ChatCompletionResponse(id=response_id, created=int(time.time()), model=self.model_name,
                                              choices=choices, usage=streaming.usage_of(outputs),
                                              prompt_logprobs=logprobs_format.prompt_logprobs_json(
                                                  outputs[0].prompt_logprobs)))

    # ---- /tokenize, /detokenize ----
    async def tokenize(self, request: Request) -> Response:
        body = await self._parse(request, lambda data: P.TokenizeChatRequest if "messages" in data
                                 else P.TokenizeCompletionRequest)
        if self.tokens is None:
            raise ApiError(400, "this server runs without a tokenizer (model.skip_tokenizer_init)")
        try:
            if isinstance(body, P.TokenizeChatRequest):
                chat = await self._render(body)
                result = await self.tokens.tokenize_body(None, add_special_tokens=body.add_special_tokens,
                                                         return_token_strs=body.return_token_strs, **chat)
            else:
                self._check_prompt_chars(body.prompt, "prompt")
                result = await self.tokens.tokenize_body(body.prompt, None, add_special_tokens=body.add_special_tokens,
                                                         return_token_strs=body.return_token_strs)
        except TokenizeError as err:
            param = "messages" if isinstance(body, P.TokenizeChatRequest) else "prompt"
            raise _tokenize_error(err, param, self.config.retry_after_s) from None
        return Response(result, media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        body = await self._parse(request, P.DetokenizeRequest)
        if self.tokens is None:
            raise ApiError(400, "this server runs without a tokenizer (model.skip_tokenizer_init)")
        vocab_size = len(self.engine.tokenizer)
        bad = next((t for t in body.tokens if t >= vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is out of vocabulary (vocab_size {vocab_size})", "tokens")
        text = await self._tokenizing("tokens", self.tokens.decode(body.tokens, skip_special_tokens=False))
        return Response(json.dumps({"prompt": text}), media_type="application/json")


# ---- helpers ---------------------------------------------------------------------------------------------------
def _tokenize_error(err: TokenizeError, param: str, retry_after_s: int) -> ApiError:
    if err.kind == "template":
        return ApiError(400, f"the chat template failed: {err}", "messages")
    if err.kind == "value":
        return ApiError(400, str(err), param)
    if err.kind == "unavailable":
        return ApiError(503, str(err), headers={"Retry-After": str(retry_after_s)})
    return ApiError(500, f"tokenization failed: {err}")


def _validation_error(err: ValidationError) -> ApiError:
    errors = err.errors(include_url=False)
    # A value that fits no member of a union gets one error per member: prefer one that is not a plain
    # type mismatch ("List should have at most 32 items" over "Input should be a valid string").
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    if first["type"].endswith("_type") and len(errors) > 1 and first["loc"]:
        return ApiError(400, f"{first['loc'][0]}: {_shown(first.get('input'))} is of none of the accepted types "
                             f"(mixed strings and token ids?)", str(first["loc"][0]))
    # Union members add their type tags ("constrained-str", "list[int]") to the location: keep field names.
    loc = [str(part) for part in first["loc"] if isinstance(part, int) or (_FIELD_NAME.match(part)
                                                                            and part not in _TYPE_TAGS)]
    if first["type"] == "value_error":  # our model validators: the message names the field
        message = str(first["ctx"]["error"])
        return ApiError(400, message, loc[0] if loc else param_of(message, _KNOWN_PARAMS))
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"{'.'.join(loc)} is not a field of this route; leave it out", loc[0] if loc else None)
    return ApiError(400, f"{'.'.join(loc)}: {first['msg']} (got {_shown(first.get('input'))})",
                    loc[0] if loc else None)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
