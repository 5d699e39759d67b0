"""Offline batch generation with vLLM's API: `LLM(model).generate(prompts, SamplingParams(...))`.

    prompts (+ one SamplingParams or one per prompt) -> every request validated first (a bad one
    raises ValueError before anything is queued) -> engine.enqueue -> step until done (tqdm)
    -> RequestOutputs in input order

The engine is an Engine, or a DataParallelEngine when parallel.data > 1 (engine_client.EngineClient).
With parallel.num_processes > 1, LLM runs on process 0 only; the others run distributed.run_follower.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from jaxserve.config import EngineConfig, load_config
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import Engine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

PromptType = str | dict[str, Any]


class LLM:
    """An engine for offline batch generation. `LLM(model="dir", max_num_seqs=8, ...)`: keyword
    arguments override the defaults of jaxserve/config.py by their flat names."""

    def __init__(self, model: str | os.PathLike | None = None, *, config: EngineConfig | None = None,
                 progress: bool = True, **engine_overrides: Any):
        config = config or EngineConfig()
        if model is not None:
            engine_overrides["model"] = str(model)
        self.config = config.with_overrides(**engine_overrides) if engine_overrides else config
        # parallel.data > 1: one engine per replica behind the same API (jaxserve/data_parallel.py).
        self.engine = (Engine(self.config, progress=progress) if self.config.parallel.data == 1
                       else DataParallelEngine(self.config, progress=progress))

    @classmethod
    def from_config(cls, path: str | os.PathLike, **engine_overrides: Any) -> LLM:
        return cls(config=load_config(path), **engine_overrides)

    def close(self) -> None:
        """Shut the engine down (EngineClient.close: a KV disk tier gets the cached blocks)."""
        self.engine.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one int for every prompt, or one per prompt (scheduler.policy "priority": lower first).
        A max_tokens past the context does not raise: generation stops at max_model_len ("length")."""
        single = isinstance(prompts, (str, dict))
        prompt_list = [prompts] if single else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} "
                                 "prompts; pass one SamplingParams or one per prompt")
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompt_list)
        else:
            priorities = list(priority)
            if len(priorities) != len(prompt_list):
                raise ValueError(f"priority has {len(priorities)} entries but there are {len(prompt_list)} prompts; "
                                 "pass one int or one per prompt")
        prepared = [self.engine.prepare_request(prompt, params or self._default_params(), priority=prio)
                    for prompt, params, prio in zip(prompt_list, params_list, priorities)]
        return self._run(prepared, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation rendered by the model's chat template (or `chat_template`),
        then generated as a prompt. `continue_final_message` leaves the last message open for the model to
        continue (instead of a generation prompt); `tools` are passed to the template (the reply's tool calls
        are plain text here)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or any(not conv for conv in conversations):
            raise ValueError("messages must not be empty")
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tools=tools, chat_template=chat_template,
                                                 continue_final_message=continue_final_message,
                                                 **(chat_template_kwargs or {}))
            # The template writes special tokens (e.g. BOS) itself.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _default_params(self) -> SamplingParams:
        """vLLM applies the checkpoint's generation_config.json sampling defaults."""
        return SamplingParams(**{k: v for k, v in self.engine.sampling_defaults.items()
                                 if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")})

    def _run(self, prepared, use_tqdm: bool) -> list[RequestOutput]:
        order = {p.request_id: i for i, p in enumerate(prepared)}
        for p in prepared:
            self.engine.enqueue(p)
        results: list[RequestOutput | None] = [None] * len(prepared)
        with tqdm(total=len(prepared), desc="generating", disable=not use_tqdm) as bar:
            remaining = len(prepared)
            while remaining:
                for output in self.engine.step(final_only=True):
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        remaining -= 1
                        bar.update()
        return results  # type: ignore[return-value]
