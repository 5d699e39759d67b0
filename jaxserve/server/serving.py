"""The OpenAI routes' logic: HTTP request -> engine requests -> JSON response or SSE stream.

    body --parse (400)--> model (404) --> admission pre-check (429 / 503, before any tokenizing)
    --thread pool--> chat template + tokenize + engine.prepare_request   (ValueError -> 400 naming the param)
    --> bridge.submit (429 / 503) --> RequestGroup
        stream=false: wait for the final outputs, racing the client's disconnect (then abort)
        stream=true:  SSE chunks of text deltas (+ a usage chunk) and `data: [DONE]`; the response aborts
                      whatever is unfinished when it ends for any reason (client gone included)

Choice i of prompt p is choice `p * n + i` of the response. Outputs are cumulative, so a delta is the
text / token ids past what was already sent: nothing is lost or sent twice however outputs coalesce.
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
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.server import logprobs_format
from jaxserve.server import protocol as P
from jaxserve.server.bridge import EngineBridge, RequestGroup
from jaxserve.server.errors import ApiError, error_body, param_of
from jaxserve.tokenizer import SPECIAL_TOKEN_NAMES, ChatTemplateError

_DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_KNOWN_PARAMS = (set(P.ChatCompletionRequest.model_fields) | set(P.CompletionRequest.model_fields)
                 | {"prompt_token_ids", "stop_token_ids"})


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


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


_DONE = "data: [DONE]\n\n"
_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class Serving:
    def __init__(self, engine: EngineClient, bridge: EngineBridge, config: ServerConfig,
                 model_name: str):
        self.engine = engine
        self.bridge = bridge
        self.config = config
        self.model_name = model_name
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="jaxserve-prepare")
        self.defaults = {k: v for k, v in engine.sampling_defaults.items() if k in _DEFAULT_SAMPLING_KEYS}
        # Template variables a request may not set: the renderer's own arguments and the special tokens.
        tokenizer = engine.tokenizer
        self._reserved_template_kwargs = (set() if tokenizer is None else
                                          set(inspect.signature(tokenizer.apply_chat_template).parameters)
                                          | set(SPECIAL_TOKEN_NAMES) | set(tokenizer.special_tokens_map))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- request handling common to both routes ----
    async def _parse(self, request: Request, model_cls: type[P.OpenAIRequest]) -> P.OpenAIRequest:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(400, f"Content-Type must be application/json, got {media_type or 'none'!r}")
        try:
            data = json.loads(await request.body())
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ApiError(400, f"the request body is not valid UTF-8 JSON: {err}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as err:
            raise _validation_error(err) from None
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist.", "model")
        return body

    def _sampling_params(self, body: P.OpenAIRequest):
        try:
            return body.sampling_params(self.defaults)
        except ValueError as err:
            raise ApiError(400, str(err), param_of(str(err), _KNOWN_PARAMS)) from None

    async def _prepare(self, prompts: list, params, body: P.OpenAIRequest, request: Request, prefix: str,
                       render: Callable[[], dict] | None = None) -> list[PreparedRequest]:
        """Render (chat) and tokenize in the thread pool: neither may block the event loop."""
        tenant = request.scope.get("jaxserve.tenant")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        prompt_param = "messages" if render is not None else "prompt"

        def work() -> list[PreparedRequest]:
            try:
                items = [render()] if render is not None else prompts
                return [self.engine.prepare_request(prompt, params, request_id=f"{request_id}-{i}",
                                                    priority=body.priority, cache_salt=body.cache_salt, tenant=tenant,
                                                    strict=True)  # max_tokens past the context: 400
                        for i, prompt in enumerate(items)]
            except ChatTemplateError as err:
                raise ApiError(400, f"the chat template failed: {err}", "messages") from None
            except ValueError as err:
                message = str(err)
                param = param_of(message, _KNOWN_PARAMS) or prompt_param
                raise ApiError(400, message, "prompt" if param == "prompt_token_ids" else param) from None

        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

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

    def _usage(self, outputs: dict[int, RequestOutput]) -> P.UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
        completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # ---- /v1/completions ----
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, P.CompletionRequest)
        prompts = body.prompts()
        self.bridge.check_admission(len(prompts))
        params = self._sampling_params(body)
        prepared = await self._prepare(prompts, params, body, request, "cmpl")
        group = self.bridge.submit(prepared)
        response_id = prepared[0].request_id.rsplit("-", 1)[0]
        echoes = ([""] * len(prepared) if not body.echo else await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: [self._echo_text(p) for p in prepared]))  # detokenizing: off the event loop too
        if body.stream:
            return _EventStream(self._completion_stream(group, body, params.n, response_id, echoes), group)
        outputs = await self._collect(request, group)
        if outputs is None:
            return Response(status_code=499)
        choices = []
        for prompt_index, output in sorted(outputs.items()):
            prompt_logprobs = logprobs_format.prompt_logprobs_json(output.prompt_logprobs)
            for c in output.outputs:
                if body.echo:
                    text, logprobs = logprobs_format.echo_choice(echoes[prompt_index], output, c, body.max_tokens,
                                                                 body.logprobs, self.engine.tokenizer)
                else:
                    text = c.text
                    logprobs = _completion_logprobs(c.logprobs, 0)[0] if c.logprobs is not None else None
                choices.append(P.CompletionChoice(index=prompt_index * params.n + c.index, text=text,
                                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs))
        return _json(P.CompletionResponse(id=response_id, created=int(time.time()), model=self.model_name,
                                          choices=choices, usage=self._usage(outputs)))

    def _echo_text(self, prepared: PreparedRequest) -> str:
        if prepared.prompt is not None or self.engine.tokenizer is None:
            return prepared.prompt or ""
        return self.engine.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)

    async def _completion_stream(self, group: RequestGroup, body: P.CompletionRequest, n: int, response_id: str,
                                 echoes: list[str]) -> AsyncIterator[str]:
        created = int(time.time())
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}

        def chunk(choices):
            return _sse(P.CompletionResponse(id=response_id, created=created, model=self.model_name,
                                             choices=choices))

        if body.echo:
            yield chunk([P.CompletionChoice(index=p * n + i, text=echo, logprobs=None, finish_reason=None)
                         for p, echo in enumerate(echoes) for i in range(n)])
        try:
            async for updates in group:
                latest.update(updates)
                choices = []
                for prompt_index, output in updates.items():
                    for c in output.outputs:
                        index = prompt_index * n + c.index
                        delta = _delta(c, index, sent_chars, sent_tokens)
                        if delta is None:
                            continue
                        text, new_logprobs = delta
                        logprobs = None
                        if new_logprobs is not None:
                            start = offsets.get(index, len(echoes[prompt_index]))
                            logprobs, offsets[index] = _completion_logprobs(new_logprobs, start)
                        choices.append(P.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield chunk(choices)
        except Exception as err:  # noqa: BLE001 - after the headers went out, errors travel in the stream
            yield f"data: {error_body(500, str(err)).decode()}\n\n"
        if body.include_usage:
            yield _sse(P.CompletionResponse(id=response_id, created=created, model=self.model_name, choices=[],
                                            usage=self._usage(latest)))
        yield _DONE

    # ---- /v1/chat/completions ----
    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, P.ChatCompletionRequest)
        if self.engine.tokenizer is None:
            raise ApiError(400, "this server runs without a tokenizer (model.skip_tokenizer_init), so it cannot "
                                "render chats; send token ids to /v1/completions", "messages")
        self.bridge.check_admission(1)
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
        params = self._sampling_params(body)
        tokenizer = self.engine.tokenizer

        def render() -> dict:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 chat_template=body.chat_template,
                                                 continue_final_message=body.continue_final_message, **kwargs)
            # The template writes special tokens (e.g. BOS) itself.
            return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

        prepared = await self._prepare([], params, body, request, "chatcmpl", render)
        group = self.bridge.submit(prepared)
        response_id = prepared[0].request_id.rsplit("-", 1)[0]
        top_n = body.top_logprobs or 0
        if body.stream:
            return _EventStream(self._chat_stream(group, body, params.n, response_id, top_n), group)
        outputs = await self._collect(request, group)
        if outputs is None:
            return Response(status_code=499)
        choices = [P.ChatChoice(index=c.index, message=P.ChatMessageOut(content=c.text),
                                logprobs=_chat_logprobs(c.logprobs, top_n) if c.logprobs is not None else None,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in outputs[0].outputs]
        return _json(P.ChatCompletionResponse(id=response_id, created=int(time.time()), model=self.model_name,
                                              choices=choices, usage=self._usage(outputs),
                                              prompt_logprobs=logprobs_format.prompt_logprobs_json(
                                                  outputs[0].prompt_logprobs)))

    async def _chat_stream(self, group: RequestGroup, body: P.ChatCompletionRequest, n: int, response_id: str,
                           top_n: int) -> AsyncIterator[str]:
        created = int(time.time())
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}

        def chunk(choices, **usage):
            return _sse(P.ChatCompletionStreamResponse(id=response_id, created=created, model=self.model_name,
                                                       choices=choices, **usage))

        for index in range(n):
            yield chunk([P.ChatStreamChoice(index=index, delta=P.DeltaMessage(role="assistant", content=""),
                                            logprobs=None, finish_reason=None)])
        try:
            async for updates in group:
                latest.update(updates)
                choices = []
                for c in updates[0].outputs:
                    delta = _delta(c, c.index, sent_chars, sent_tokens)
                    if delta is None:
                        continue
                    text, new_logprobs = delta
                    message = P.DeltaMessage(content=text) if text else P.DeltaMessage()
                    logprobs = _chat_logprobs(new_logprobs, top_n) if new_logprobs is not None else None
                    choices.append(P.ChatStreamChoice(index=c.index, delta=message, logprobs=logprobs,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield chunk(choices)
        except Exception as err:  # noqa: BLE001 - after the headers went out, errors travel in the stream
            yield f"data: {error_body(500, str(err)).decode()}\n\n"
        if body.include_usage:
            yield chunk([], usage=self._usage(latest))
        yield _DONE


# ---- helpers ---------------------------------------------------------------------------------------------------
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


def _delta(c: CompletionOutput, index: int, sent_chars: dict[int, int],
           sent_tokens: dict[int, int]) -> tuple[str, list | None] | None:
    """The unsent text and logprobs of one sequence (None if there is nothing to send); marks them sent.
    A finished sequence is sent once more with its finish reason, then never again."""
    chars, tokens = sent_chars.get(index, 0), sent_tokens.get(index, 0)
    if chars < 0:
        return None  # finish already sent
    text = c.text[chars:]
    new_logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
    if not text and not new_logprobs and c.finish_reason is None:
        return None
    sent_chars[index] = -1 if c.finish_reason is not None else len(c.text)
    sent_tokens[index] = len(c.token_ids)
    return text, new_logprobs


def _completion_logprobs(entries: list[dict[int, Logprob]], offset: int) -> tuple[P.CompletionLogprobs, int]:
    """OpenAI's legacy logprobs block for `entries` (sampled token first in each), text offsets from `offset`."""
    result = P.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])  # set: streamed
    for entry in entries:
        sampled = next(iter(entry.values()))
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset


def _chat_logprobs(entries: list[dict[int, Logprob]], top_n: int) -> P.ChatChoiceLogprobs:
    def top(lp: Logprob) -> dict[str, Any]:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for entry in entries:
        sampled = next(iter(entry.values()))
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n),
                        key=lambda lp: lp.rank)
        content.append(P.ChatLogprob(**top(sampled), top_logprobs=[P.ChatTopLogprob(**top(lp)) for lp in ranked]))
    return P.ChatChoiceLogprobs(content=content)
