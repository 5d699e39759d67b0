"""Token-budget continuous batching (vLLM V1 style): chunked prefill, mixed batches, preemption.

    add_request -> waiting queue
    schedule():  running requests first (each gets its next tokens: a prefill chunk or 1 decode
                 token), then waiting ones while the token budget, max_num_seqs and KV blocks last
                 -> SchedulerOutput (and num_computed_tokens advanced for what was scheduled)
    update_from_output(RunnerOutput): append sampled tokens, check eos / stop ids / length,
                 free finished requests -> RequestUpdates for the engine

NOTE: there is no "prefill phase" or "decode phase": a request has `num_computed_tokens`, and a
step gives it up to `num_tokens - num_computed_tokens` new tokens within the budget.
When blocks run out, the running request with the lowest priority (then the latest arrival) is
preempted by recompute: its blocks are freed, it keeps its generated tokens and waits again.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_types import (Logprobs, NewRequestData, RunnerOutput, ScheduledRequest,
                                       SchedulerOutput)
from jaxserve.request import Request, RequestStatus


@dataclasses.dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, for the engine's output processing."""

    request_id: str
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None  # set when the request finished this step
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None


def _victim_key(request: Request):
    """Preemption order: lowest priority (highest value) first, then the latest arrival."""
    return (request.priority, request.arrival_time)


class WaitingQueue:
    """FCFS (a deque; preempted requests go back to the front) or priority (a heap)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._items: collections.deque[Request] | list[Request] = collections.deque() if policy == "fcfs" else []

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._items.appendleft(request) if front else self._items.append(request)
        else:
            heapq.heappush(self._items, request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft() if self.policy == "fcfs" else heapq.heappop(self._items)

    def remove(self, request: Request) -> None:
        self._items.remove(request)
        if self.policy != "fcfs":
            heapq.heapify(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int):
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled, so long prompts could never be scheduled; "
                f"enable chunked prefill or raise max_num_batched_tokens")
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # runner state to drop at the next step
        self.step_count = 0
        self.num_preemptions = 0

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, or a stop string found by the engine)."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def abort_requests(self, request_ids) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_ids.add(request.request_id)
        self.waiting.push(request, front=True)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        self._make_room_for_priority_arrival()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        allocate = self.kv_cache.allocate_slots
        scheduled: dict[str, tuple[Request, ScheduledRequest]] = {}
        preempted = False

        # Running requests first, in order.
        index = 0
        running = self.running
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new <= 0:
                index += 1
                continue
            while (new_blocks := allocate(request, num_new)) is None:
                victim = max(reversed(self.running), key=_victim_key)  # ties: the latest scheduled
                preempted = True
                if victim.request_id in scheduled:
                    # Taken out of this step again; the KV cache manager uncaches its blocks that this
                    # step would have written, so no later prefix hit can read them unwritten.
                    budget += scheduled.pop(victim.request_id)[1].num_new_tokens
                if self.running.index(victim) < index:
                    index -= 1
                self._preempt(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue  # `request` itself was preempted; the list shifted under `index`
            scheduled[request.request_id] = (request, ScheduledRequest(
                request.request_id, request.num_computed_tokens, num_new, new_blocks))
            budget -= num_new
            index += 1

        # Then waiting requests, unless this step had to preempt.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_ids, num_hit = self.kv_cache.get_computed_blocks(request)
            if not self.config.enable_chunked_prefill and request.num_tokens - num_hit > budget:
                break
            request.num_computed_tokens = num_hit
            num_new = self._num_new_tokens(request, budget)
            new_blocks = allocate(request, num_new, computed_ids)
            if new_blocks is None:
                request.num_computed_tokens = 0
                break
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            scheduled[request.request_id] = (request, ScheduledRequest(
                request.request_id, num_hit, num_new, new_blocks,
                new=NewRequestData(list(request.all_token_ids), request.num_prompt_tokens, request.sampling_params,
                                   request.seed, request.eos_token_ids, request.max_tokens)))
            budget -= num_new

        items = []
        for request, item in scheduled.values():
            request.num_computed_tokens += item.num_new_tokens
            item.samples = request.num_computed_tokens == len(request.all_token_ids)
            items.append(item)
        finished, self._finished_ids = self._finished_ids, set()
        self.step_count += 1
        return SchedulerOutput(items, self.config.max_num_batched_tokens - budget, finished, self.step_count)

    def _make_room_for_priority_arrival(self) -> None:
        """Priority policy: while the best waiting request outranks the worst running one and its first
        chunk does not fit, preempt the worst running request.

        NOTE: this runs before anything is scheduled in the step. Preempting later, after waiting
        requests took prefix hits on blocks a victim registered this step, would leave those hits
        pointing at blocks whose K/V is never written.
        """
        if self.config.policy != "priority" or not self.waiting:
            return
        head = self.waiting.peek()
        chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
        blocks_needed = -(-chunk // self.kv_cache.block_size)
        while self.running and self.kv_cache.num_free_blocks < blocks_needed:
            victim = max(reversed(self.running), key=_victim_key)  # ties: the latest scheduled
            if not head < victim:
                return
            self._preempt(victim)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestUpdate]:
        updates = []
        requests, running_status, max_model_len = self.requests, RequestStatus.RUNNING, self.max_model_len
        logprobs = runner_output.logprobs or [None] * len(runner_output.request_ids)
        for request_id, token, token_logprobs in zip(runner_output.request_ids, runner_output.sampled_token_ids,
                                                     logprobs):
            request = requests.get(request_id)
            if request is None or request.status != running_status:
                continue  # finished or preempted since it was scheduled: the token is dropped
            tokens = request.all_token_ids
            tokens.append(token)
            # Stop checks (inlined: this loop runs for every running request every step).
            params = request.sampling_params
            num_output = len(tokens) - len(request.prompt_token_ids)
            status = stop_reason = None
            # Length first, as vLLM: an eos that is also the max_tokens-th token finishes with "length".
            if num_output >= request.max_tokens or len(tokens) >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            elif num_output >= params.min_tokens and (token in request.eos_token_ids and not params.ignore_eos):
                status = RequestStatus.FINISHED_STOPPED
            elif num_output >= params.min_tokens and params.stop_token_ids and token in params.stop_token_ids:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, token
            if status is not None:
                request.stop_reason = stop_reason
                self.running.remove(request)
                self._finish(request, status)
            updates.append(RequestUpdate(request_id, [token], status, stop_reason, token_logprobs))
        return updates
