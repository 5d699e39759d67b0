"""Input processing: a prompt and its SamplingParams -> a validated, tokenized PreparedRequest
(host-only; no JAX).

    prompt (str | {"prompt_token_ids": [...]} | {"prompt": str} | [token ids]) + SamplingParams
    --verify against the engine's limits, tokenize, check ids and lengths, resolve max_tokens and seed-->
    PreparedRequest (queues nothing; the engine's `enqueue` fans it out into n child requests)

Every bad input raises ValueError naming the parameter, so nothing is queued and the engine keeps
serving. max_tokens past the context: generation stops at max_model_len with finish_reason "length"
(vLLM's behaviour), or, with `strict` (the server), a ValueError. A prompt that alone fills
max_model_len is always an error.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

PromptType = str | dict[str, Any] | list[int]


@dataclasses.dataclass
class PreparedRequest:
    """A validated request, ready to enqueue."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: what fits in max_model_len when params.max_tokens is None (or too large)
    seed: int
    priority: int
    cache_salt: str | None
    arrival_time: float
    tenant: str | None = None
    # Prefill/decode disaggregation: this request's transfer (set by a PD instance's engine; jaxserve/pd)
    kv_transfer_params: dict | None = None


# The keys a prompt dict may have, and vLLM's prompt keys jaxserve has nothing for (taken only when empty).
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_UNSERVED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds",
                         "token_type_ids")


def _check_prompt_keys(prompt: dict) -> None:
    """A prompt dict's keys (vLLM's TextPrompt / TokensPrompt): a misspelt or unserved key raises instead of
    being ignored."""
    for key in _UNSERVED_PROMPT_KEYS:
        value = prompt.get(key)
        if value is not None and (not hasattr(value, "__len__") or len(value)):
            raise ValueError(f"{key} is not supported: jaxserve serves text prompts (leave {key} out)")
    unknown = sorted(set(prompt) - set(PROMPT_KEYS) - set(_UNSERVED_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"a prompt dict has unknown key(s) {unknown}; its keys are {list(PROMPT_KEYS)}")


class InputProcessor:
    """Validates and tokenizes requests against one engine's limits."""

    def __init__(self, tokenizer: Tokenizer | None, *, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], max_n: int, max_logprobs: int, max_banned: int, seed: int):
        """`max_banned`: how many eos + stop token ids the sampler can suppress under min_tokens.
        `seed` seeds the seeds of requests that give none, so runs repeat."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_n = max_n
        self.max_logprobs = max_logprobs
        self.max_banned = max_banned
        self._seeds = random.Random(seed)
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def prepare(self, prompt: PromptType, params: SamplingParams | None = None, *, request_id: str | None = None,
                priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                strict: bool = False) -> PreparedRequest:
        """Validate and tokenize; raises ValueError naming the parameter. `strict`: max_tokens past the
        context is an error (the server's 400) instead of generation stopping at max_model_len."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify_against_engine(max_n=self.max_n, max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
        if self.tokenizer is None and (params.stop or isinstance(prompt, str)):
            raise ValueError("this engine runs without a tokenizer (skip_tokenizer_init): pass prompts as "
                             "{'prompt_token_ids': [...]} and no stop strings")
        text, token_ids = self._tokenize(prompt)
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size),
                   None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is out of vocabulary (vocab_size {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model length of "
                f"{self.max_model_len} minus one generated token. Make sure that max_model_len is no smaller than the "
                f"number of text tokens plus one, or shorten the prompt.")
        room = self.max_model_len - len(token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            if strict:
                raise ValueError(
                    f"max_tokens={max_tokens} plus the prompt's {len(token_ids)} tokens exceeds max_model_len="
                    f"{self.max_model_len}; lower max_tokens or shorten the prompt")
            max_tokens = room  # generation stops at max_model_len: finish_reason "length"
        if params.min_tokens > 0 and len(self.eos_token_ids) + len(params.stop_token_ids) > self.max_banned:
            raise ValueError(f"stop_token_ids: at most {self.max_banned - len(self.eos_token_ids)} stop token ids are "
                             f"supported together with min_tokens > 0")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return PreparedRequest(request_id or self.new_request_id(), text, token_ids, params, max_tokens, seed,
                               priority, cache_salt, time.monotonic(), tenant)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list):  # token ids, as {"prompt_token_ids": prompt} (checked by the caller)
            return None, list(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            _check_prompt_keys(prompt)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                if self.tokenizer is None:
                    raise ValueError("this engine runs without a tokenizer (skip_tokenizer_init): pass prompts as "
                                     "{'prompt_token_ids': [...]} and no stop strings")
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with prompt_token_ids, "
                         f"got {type(prompt).__name__}")
