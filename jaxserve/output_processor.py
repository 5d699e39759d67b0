"""Output processing: the scheduler's per-step token updates -> RequestOutputs (host-only; no JAX).

    enqueue:  add(prepared, child requests, tokenizer) -> one OutputStream per child (detokenizer, stop strings)
    step:     process(updates) -> per child: OutputStream.append (text delta, stop strings, logprobs)
              -> finish on eos / stop token / length / a completed stop string
              -> one RequestOutput per request that changed (its n children together)
              and the child ids that a stop string ended, which the engine tells the scheduler
    abort:    abort(request_id) -> the request's final output (finish_reason "abort" where unfinished)

A request with n > 1 has n children ("{i}_{id}"); its RequestOutput holds one CompletionOutput per
child and is final once every child finished. A finished request is forgotten here.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.core.sched_types import PromptLogprobs
from jaxserve.core.sched_types import StepUpdates
from jaxserve.input_processor import PreparedRequest
from jaxserve.outputs import OutputStream, PromptLogprobsStream, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass
class _Parent:
    prepared: PreparedRequest
    child_ids: list[str]
    requests: list[Request]
    streams: list[OutputStream]
    metrics: RequestMetrics
    finished: set[str] = dataclasses.field(default_factory=set)
    prompt_logprobs: PromptLogprobsStream | None = None  # with SamplingParams.prompt_logprobs


class OutputProcessor:
    def __init__(self):
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def request_ids(self) -> list[str]:
        """The requests not yet finished."""
        return list(self._parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def add(self, prepared: PreparedRequest, requests: list[Request], tokenizer: Tokenizer | None) -> None:
        """Track `prepared`, whose children (in order) are `requests`, detokenized with `tokenizer` (None:
        token ids only)."""
        params = prepared.params if tokenizer is not None else dataclasses.replace(prepared.params, detokenize=False)
        streams = [OutputStream(tokenizer, params, prepared.prompt_token_ids, index)
                   for index in range(len(requests))]
        child_ids = [request.request_id for request in requests]
        for index, child_id in enumerate(child_ids):
            self._child_to_parent[child_id] = (prepared.request_id, index)
        prompt_logprobs = None
        if prepared.params.prompt_logprobs is not None:
            prompt_logprobs = PromptLogprobsStream(tokenizer if params.detokenize else None,
                                                   prepared.prompt_token_ids)
        self._parents[prepared.request_id] = _Parent(prepared, child_ids, requests, streams,
                                                     RequestMetrics(prepared.arrival_time), prompt_logprobs=prompt_logprobs)

    def add_prompt_logprobs(self, chunks: list[PromptLogprobs]) -> None:
        """A step's prompt log-probs (runs of prompt positions per child), before that step's tokens."""
        for chunk in chunks:
            parent_id, _ = self._child_to_parent.get(chunk.request_id, (None, 0))
            parent = self._parents.get(parent_id)
            if parent is not None and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.add(chunk)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished child of `request_id` with "abort"; its final output (None if unknown)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child_id, stream in zip(parent.child_ids, parent.streams):
            if child_id not in parent.finished:
                stream.finish("abort", None)
                parent.finished.add(child_id)
        return self._output(parent)

    def process(self, updates: StepUpdates, final_only: bool = False) -> tuple[list[RequestOutput], list[str]]:
        """One step's tokens -> (outputs of the requests that changed, or with `final_only` of those that
        finished; the child ids a stop string ended, which the scheduler must finish as stopped)."""
        changed: dict[str, _Parent] = {}
        stopped: list[str] = []
        now = time.monotonic()
        finished, logprobs, runs = updates.finished, updates.logprobs, updates.runs
        for i, (request, token) in enumerate(zip(updates.requests, updates.tokens)):
            request_id = request.request_id
            parent_id, index = self._child_to_parent[request_id]
            parent = self._parents[parent_id]
            stream = parent.streams[index]
            status, stop_reason = finished.get(request_id, (None, None)) if finished else (None, None)
            by_token = status == RequestStatus.FINISHED_STOPPED
            token_logprobs = logprobs[i] if logprobs is not None else None
            new_tokens = runs.get(i, [token]) if runs else [token]
            if len(new_tokens) > 1:  # a run of accepted guesses: logprobs per token
                token_logprobs = updates.run_logprobs.get(i) if token_logprobs else None
            else:
                token_logprobs = [token_logprobs] if token_logprobs else None
            stop_str = stream.append(new_tokens, token_logprobs, by_token, cut_at_stop=True)
            if stop_str is not None and status is None:
                stopped.append(request_id)
                status, stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is not None:
                stream.finish(status.finish_reason, stop_reason)
                parent.finished.add(request_id)
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            changed[parent_id] = parent
        outputs = [self._output(parent) for parent in changed.values()
                   if not final_only or len(parent.finished) == len(parent.child_ids)]
        return outputs, stopped

    def _output(self, parent: _Parent) -> RequestOutput:
        finished = len(parent.finished) == len(parent.child_ids)
        prepared = parent.prepared
        if finished:
            parent.metrics.finished_time = time.monotonic()
            del self._parents[prepared.request_id]
            for child_id in parent.child_ids:
                self._child_to_parent.pop(child_id, None)
        return RequestOutput(prepared.request_id, prepared.prompt, prepared.prompt_token_ids,
                             [stream.completion_output() for stream in parent.streams], finished,
                             max(parent.requests[0].num_cached_tokens, 0),
                             parent.prompt_logprobs.result() if parent.prompt_logprobs is not None else None,
                             metrics=parent.metrics)
