"""Prompt logprobs in the OpenAI routes, in vLLM's formats.

    RequestOutput.prompt_logprobs --prompt_logprobs_json--> `prompt_logprobs` of each /v1/completions
        choice and of a /v1/chat/completions response: [null, {token id: {logprob, rank, decoded_token}}, ...]
    echo=true --echo_choice--> the choice's text and legacy `logprobs` block: the prompt first, then the
        generated tokens (with max_tokens=0 the prompt alone, as vLLM, which generates one token and
        shows none); with logprobs=N the block covers the prompt tokens too, the first one's logprob and
        top_logprobs null (nothing scores it), text_offset running on from 0 through both; a request
        aborted before its prompt was scored has null there for every prompt token

As vLLM, a logprob of -inf is written as -9999.0 (JSON has no infinity), and each token of the block is
its own decoded text; the top_logprobs of a position hold its chosen token and the top-N.
"""

from __future__ import annotations

from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.server import protocol as P
from jaxserve.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    if entries is None:
        return None
    return [None if entry is None else
            {token_id: P.LogprobInfo(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in entry.items()} for entry in entries]


def echo_choice(echo: str, output: RequestOutput, completion: CompletionOutput, max_tokens: int | None,
                num_logprobs: int | None, tokenizer: Tokenizer | None) -> tuple[str, P.CompletionLogprobs | None]:
    """The text and logprobs block of an echo=true choice."""
    prompt_only = max_tokens == 0
    text = echo if prompt_only else echo + completion.text
    if num_logprobs is None:
        return text, None
    token_ids = list(output.prompt_token_ids)
    if output.prompt_logprobs is not None:
        entries: list[dict[int, Logprob] | None] = list(output.prompt_logprobs)
    elif completion.finish_reason == "abort":  # aborted before its whole prompt was scored
        entries = [None] * len(token_ids)
    else:  # (the engine returns them once the whole prompt is scored, before any token)
        raise RuntimeError(f"request {output.request_id} finished without its prompt logprobs")
    if not prompt_only:
        token_ids += completion.token_ids
        entries += completion.logprobs or []
    return text, completion_logprobs(token_ids, entries, num_logprobs, tokenizer)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], num_logprobs: int,
                        tokenizer: Tokenizer | None) -> P.CompletionLogprobs:
    """The legacy block for `token_ids` with one entry each (None: no logprob), offsets from 0."""
    block = P.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = 0
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            token = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""
            block.token_logprobs.append(None)
            block.top_logprobs.append(None)
        else:
            token = entry[token_id].decoded_token or ""
            block.token_logprobs.append(_finite(entry[token_id].logprob))
            # the chosen token and the top-N (-1: all of them)
            kept = list(entry.values()) if num_logprobs == -1 else list(entry.values())[: num_logprobs + 1]
            block.top_logprobs.append({(lp.decoded_token or ""): _finite(lp.logprob) for lp in kept})
        block.tokens.append(token)
        block.text_offset.append(offset)
        offset += len(token)
    return block
