"""OpenAI-compatible request and response models (pydantic v2), with vLLM's extra request fields.

    JSON body --model_validate--> CompletionRequest | ChatCompletionRequest    (bounds: 400 before any work)
              --.sampling_params(defaults)--> SamplingParams                  (vLLM ranges, engine.py limits)
    RequestOutput --serving.py--> CompletionResponse | ChatCompletionResponse | *StreamResponse chunks
    any failure --> ErrorResponse {"error": {"message", "type", "param", "code"}}

Every count-like field has a hard upper bound here, so no request makes the server loop or allocate in
proportion to a number it sends (vLLM CVE-2026-34756: a huge `n`). Limits that depend on the engine
config (scheduler.max_n, scheduler.max_logprobs, max_model_len) are checked again by the engine before
anything is queued, and the product of the counts by serving.py (server.max_request_tokens / _logprobs).

No known field is silently ignored: OpenAI and vLLM fields jaxserve does not implement (logit_bias,
tools, suffix, structured output, beam search, best_of > n, ... : UNSUPPORTED) answer 400 naming the
field unless their value asks for nothing (null, false, the default). `user` and `metadata` are
informational (as in OpenAI's API) and change nothing. Fields no API defines are accepted and logged,
as vLLM does (clients send vendor fields in `extra_body`).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_N = 128  # hard cap; scheduler.max_n (default 64) is the configured one
MAX_LOGPROBS = 1024  # hard cap; scheduler.max_logprobs (default 20) is the configured one
MAX_TOKENS = 1 << 24
MAX_PROMPTS = 64  # prompts in one /v1/completions call
MAX_STOP = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_TEMPLATE_KWARGS = 32
MAX_TOOLS = 512
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# Request fields that map 1:1 onto SamplingParams (None: not sent, the default applies).
_SAMPLING_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


# Known OpenAI / vLLM request fields jaxserve does not implement -> the values that ask for nothing
# (accepted as absent; null always is). Any other value answers 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "truncate_prompt_tokens": (),
    "allowed_token_ids": (), "bad_words": ([],), "logits_processors": ([],), "logprob_token_ids": ([],),
    "return_token_ids": (False,), "structured_outputs": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "kv_transfer_params": (), "vllm_xargs": (), "prompt_embeds": (), "mm_processor_kwargs": ({},),
    "documents": ([],), "functions": ([],), "function_call": ("none",), "audio": (), "modalities": (["text"],),
    "prediction": (), "reasoning_effort": (), "web_search_options": (), "store": (False,),
    "service_tier": ("auto", "default"),
}
INFORMATIONAL = ("user", "metadata", "parallel_tool_calls")  # no effect on generation, as OpenAI defines them


class StreamOptions(BaseModel):
    include_usage: bool = True  # as vLLM: stream_options without include_usage asks for the usage chunk
    continuous_usage_stats: bool = False  # usage (that choice's tokens so far) on every chunk too


class OpenAIRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)] | None = None  # 0: completions with echo
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    best_of: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None  # only == n: no extra candidates
    # vLLM's extra sampling fields.
    top_k: Annotated[int, Field(strict=True, ge=-(2**31), le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # one entry per prompt token (the first null): its logprob and rank, plus the top-N; -1 = all
    prompt_logprobs: Annotated[int, Field(strict=True, ge=-1, le=MAX_LOGPROBS)] | None = None
    # vLLM's extra scheduling fields.
    # One value for every prompt of the request: lower first under policy "priority"; under every policy
    # the highest value is preempted first.
    priority: Annotated[int, Field(strict=True, ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (bytes that are no valid UTF-8)
    add_special_tokens: bool | None = None  # default: true for completions; false for chat (the template adds them)
    # vLLM's prefill/decode field: set by `jaxserve router` (signed), accepted only by a PD instance
    kv_transfer_params: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"}: no structured output

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by jaxserve; leave it out")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than {'type': 'text'} (structured output) is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError(f"best_of={self.best_of} (more candidates than the n={self.n or 1} returned) is not "
                             f"supported by jaxserve; leave best_of out or set it to n")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.stream and self.prompt_logprobs not in (None, 0):  # as vLLM
            raise ValueError("prompt_logprobs are not available with stream=true; send stream=false to get them")
        if self.model_extra:
            for name, value in self.model_extra.items():
                if name in UNSUPPORTED and value is not None and not any(
                        value == allowed and type(value) is type(allowed) for allowed in UNSUPPORTED[name]):
                    raise ValueError(f"{name} is not supported by jaxserve; leave it out")
            unknown = sorted(name for name in self.model_extra if name not in UNSUPPORTED and name not in INFORMATIONAL)
            if unknown:
                logger.warning("ignoring request fields no API defines: %s", unknown[:16])
        return self

    def _sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the fields sent, over `defaults` (the checkpoint's generation config);
        raises ValueError naming the field (vLLM's ranges)."""
        values = dict(defaults)
        values.update({name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None})
        if self.stream:  # a stream never carries prompt log-probs (as vLLM's): scoring them (and skipping
            prompt_logprobs = None  # the prefix cache to do so) would be wasted
        return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(OpenAIRequest):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1,
                                                                                   max_length=MAX_PROMPTS)])
    logprobs: Annotated[int, Field(strict=True, ge=-1, le=MAX_LOGPROBS)] | None = None  # -1 = all
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported by jaxserve; leave it out")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be greater than or equal to 1 (0 only with echo=true: the prompt "
                             "alone), got 0")
        if self.echo and self.stream and (self.logprobs is not None or self.max_tokens == 0):
            raise ValueError("echo with logprobs or max_tokens=0 is not supported with stream=true; send "
                             "stream=false")
        return self

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # As OpenAI and vLLM: a completion without max_tokens stops after 16 tokens. As vLLM, echo with
        # logprobs asks for the prompt's too, and max_tokens=0 with echo generates one token, never shown.
        max_tokens = self.max_tokens if self.max_tokens is not None else 16
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling_params(defaults, max(max_tokens, 1), self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """One engine prompt per entry: text, or {"prompt_token_ids": [...]}."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, reasoning_content, ... reach the template

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message for the chat template; text content parts are joined (vLLM's "string" format)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for number, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{index}].content[{number}]: only text parts "
                                     f"({{'type': 'text', 'text': ...}}) are supported, got type {part.get('type')!r}")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        return message


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ... reach the template

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """OpenAI's function tool: shown to the model through the chat template."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: ToolFunction


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (None: no tools)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class ChatCompletionRequest(OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's chat extras.
    echo: bool = False  # the reply starts with the last message's text when that message has the reply's role
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_chat(self):
        if self.tools and self.tool_choice != "none":  # OpenAI's default with tools is "auto"
            raise ValueError(f"tool_choice={self.tool_choice or 'auto'!r} with tools needs a tool-call parser, which "
                             f"jaxserve does not have yet; send tool_choice 'none' to show the model the tools and "
                             f"get its reply as text")
        if not self.tools and self.tool_choice not in (None, "none", "auto"):  # without tools, "auto" chooses none
            raise ValueError("tool_choice other than 'none' or 'auto' needs tools (with tool_choice 'none': "
                             "jaxserve parses no tool calls yet); leave it out")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens and max_completion_tokens are the same limit; send only one")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be greater than or equal to 1, got 0")
        return self

    @property
    def response_role(self) -> str:
        """The reply's role (as vLLM's): the assistant's after a generation prompt, else the last message's
        (the model continues that message)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self) -> str:
        """With echo, the text the reply starts with: the last message's, when it has the reply's role."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role:
            return ""
        return last.template_dict(len(self.messages) - 1).get("content") or ""

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # A chat completion without a limit may fill the context (None: the engine resolves it).
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(defaults, max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     self.prompt_logprobs)


# ---- responses -------------------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class LogprobInfo(BaseModel):
    """One token of a prompt_logprobs entry (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, LogprobInfo] | None] | None = None  # vLLM's extra (set only when asked)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, LogprobInfo] | None] | None = None  # vLLM's extra (set only when asked)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelPermission(BaseModel):
    """vLLM's permission object (fixed values: the served model may be sampled, with logprobs)."""

    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str  # the checkpoint directory served
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /tokenize, /detokenize (vLLM's shapes) ----------------------------------------------------------------------
class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes them
    return_token_strs: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
