"""SSE streams of /v1/completions and /v1/chat/completions, and the logprobs blocks of both routes.

    RequestGroup updates {prompt index: cumulative RequestOutput}
        --_delta (text / logprobs past what was sent)--> one chunk per choice with something new
        --> `data: {chunk}` ... [usage chunk] `data: [DONE]`

As vLLM sends them: every chunk carries `object` and exactly one choice (its `index` says which; choice i
of prompt p is `p * n + i`), so a client reading `choices[0]` of each chunk sees every choice's text and
finish reason. With `stream_options.continuous_usage_stats` every chunk carries `usage` too: that
prompt's tokens and that choice's generated tokens so far; with `include_usage` a last chunk with no
choices carries the whole request's usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.server import protocol as P
from jaxserve.server.bridge import RequestGroup
from jaxserve.server.errors import error_body

DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel) -> str:
    # exclude_unset: fields a chunk does not set (usage, mostly) are left out, as vLLM does.
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


@dataclass(frozen=True)
class StreamSpec:
    """What a stream needs to know about its request."""

    response_id: str
    model_name: str
    n: int
    prompt_lens: list[int]  # prompt tokens of each prompt
    include_usage: bool
    continuous_usage: bool
    token_ids_as_tokens: bool  # return_tokens_as_token_ids


def usage_of(outputs: dict[int, RequestOutput]) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _choice_usage(spec: StreamSpec, prompt_index: int, generated: int) -> dict[str, P.UsageInfo]:
    if not spec.continuous_usage:
        return {}
    prompt = spec.prompt_lens[prompt_index]
    return {"usage": P.UsageInfo(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)}


def delta(c: CompletionOutput, index: int, sent_chars: dict[int, int],
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


async def completion_stream(spec: StreamSpec, group: RequestGroup, echoes: list[str] | None) -> AsyncIterator[str]:
    """`echoes`: with echo, each prompt's text (sent first, once per choice); else None."""
    created = int(time.time())
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    latest: dict[int, RequestOutput] = {}

    def chunk(choice: P.CompletionChoice, prompt_index: int, generated: int) -> str:
        return sse(P.CompletionResponse(id=spec.response_id, object="text_completion", created=created,
                                        model=spec.model_name, choices=[choice],
                                        **_choice_usage(spec, prompt_index, generated)))

    if echoes is not None:
        for p, echo in enumerate(echoes):
            for i in range(spec.n):
                yield chunk(P.CompletionChoice(index=p * spec.n + i, text=echo, logprobs=None, finish_reason=None),
                            p, 0)
    try:
        async for updates in group:
            latest.update(updates)
            for prompt_index, output in updates.items():
                for c in output.outputs:
                    index = prompt_index * spec.n + c.index
                    new = delta(c, index, sent_chars, sent_tokens)
                    if new is None:
                        continue
                    text, new_logprobs = new
                    logprobs = None
                    if new_logprobs is not None:  # (never with echo: protocol.py refuses stream + echo + logprobs)
                        logprobs, offsets[index] = completion_logprobs(new_logprobs, offsets.get(index, 0),
                                                                       spec.token_ids_as_tokens)
                    yield chunk(P.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                   finish_reason=c.finish_reason, stop_reason=c.stop_reason),
                                prompt_index, len(c.token_ids))
    except Exception as err:  # noqa: BLE001 - after the headers went out, errors travel in the stream
        yield f"data: {error_body(500, str(err)).decode()}\n\n"
    if spec.include_usage:
        yield sse(P.CompletionResponse(id=spec.response_id, object="text_completion", created=created,
                                       model=spec.model_name, choices=[], usage=usage_of(latest)))
    yield DONE


async def chat_stream(spec: StreamSpec, group: RequestGroup, top_n: int, role: str,
                      echoed: str) -> AsyncIterator[str]:
    """The chat stream: each choice's role first, then `echoed` (chat echo's start of the reply), then the
    generated text as it comes."""
    created = int(time.time())
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    latest: dict[int, RequestOutput] = {}

    def chunk(choice: P.ChatStreamChoice, generated: int) -> str:
        return sse(P.ChatCompletionStreamResponse(id=spec.response_id, object="chat.completion.chunk",
                                                  created=created, model=spec.model_name, choices=[choice],
                                                  **_choice_usage(spec, 0, generated)))

    for index in range(spec.n):
        yield chunk(P.ChatStreamChoice(index=index, delta=P.DeltaMessage(role=role, content=""),
                                       logprobs=None, finish_reason=None), 0)
        if echoed:
            yield chunk(P.ChatStreamChoice(index=index, delta=P.DeltaMessage(content=echoed), logprobs=None,
                                           finish_reason=None), 0)
    try:
        async for updates in group:
            latest.update(updates)
            for c in updates[0].outputs:
                new = delta(c, c.index, sent_chars, sent_tokens)
                if new is None:
                    continue
                text, new_logprobs = new
                message = P.DeltaMessage(content=text) if text else P.DeltaMessage()
                logprobs = (chat_logprobs(new_logprobs, top_n, spec.token_ids_as_tokens)
                            if new_logprobs is not None else None)
                yield chunk(P.ChatStreamChoice(index=c.index, delta=message, logprobs=logprobs,
                                               finish_reason=c.finish_reason, stop_reason=c.stop_reason),
                            len(c.token_ids))
    except Exception as err:  # noqa: BLE001 - after the headers went out, errors travel in the stream
        yield f"data: {error_body(500, str(err)).decode()}\n\n"
    if spec.include_usage:
        yield sse(P.ChatCompletionStreamResponse(id=spec.response_id, object="chat.completion.chunk",
                                                 created=created, model=spec.model_name, choices=[],
                                                 usage=usage_of(latest)))
    yield DONE


# ---- logprobs ----------------------------------------------------------------------------------------------------
def _token(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """The text of a logprob entry; with return_tokens_as_token_ids "token_id:N" (as vLLM), which also
    stands for tokens whose bytes are no whole UTF-8 character."""
    return f"token_id:{token_id}" if as_ids else (lp.decoded_token or "")


def completion_logprobs(entries: list[dict[int, Logprob]], offset: int,
                        as_ids: bool = False) -> tuple[P.CompletionLogprobs, int]:
    """OpenAI's legacy logprobs block for `entries` (sampled token first in each), text offsets from `offset`."""
    result = P.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])  # set: streamed
    for entry in entries:
        sampled_id, sampled = next(iter(entry.items()))
        token = _token(sampled_id, sampled, as_ids)
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({_token(token_id, lp, as_ids): lp.logprob for token_id, lp in entry.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset


def chat_logprobs(entries: list[dict[int, Logprob]], top_n: int, as_ids: bool = False) -> P.ChatChoiceLogprobs:
    def top(token_id: int, lp: Logprob) -> dict[str, Any]:
        token = _token(token_id, lp, as_ids)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for entry in entries:
        sampled_id, sampled = next(iter(entry.items()))
        ranked = sorted(((token_id, lp) for token_id, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
                        key=lambda item: item[1].rank)
        content.append(P.ChatLogprob(**top(sampled_id, sampled),
                                     top_logprobs=[P.ChatTopLogprob(**top(*item)) for item in ranked]))
    return P.ChatChoiceLogprobs(content=content)
