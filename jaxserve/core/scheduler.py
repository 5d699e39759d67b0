"""Token-budget continuous batching (vLLM V1 style): chunked prefill, mixed batches, preemption.

    add_request -> waiting queue
    schedule():  running requests first (each gets its next tokens: a prefill chunk or 1 decode
                 token), then waiting ones while the token budget, max_num_seqs and KV blocks last
                 -> SchedulerOutput (and num_computed_tokens advanced for what was scheduled)
    update_from_output(RunnerOutput): append sampled tokens, check eos / stop ids / length,
                 free finished requests -> StepUpdates (columns) for the engine

NOTE: there is no "prefill phase" or "decode phase": a request has `num_computed_tokens`, and a
step gives it up to `num_tokens + num_pending - num_computed_tokens` new tokens within the budget
(num_pending: tokens sampled by steps still in flight, under overlap scheduling).
When blocks run out, the running request with the lowest priority (then the latest arrival) is
preempted: its blocks are freed, it keeps its generated tokens and waits again, to be recomputed, or
swapped (scheduler.preemption_mode, core/preemption.py: by cost; a host tier needed), with its blocks
copied to the host tier first and loaded back into fresh blocks when it resumes, its computed tokens kept.
The waiting queue orders FCFS, by priority, or per-tenant fair (core/fairness.py: each step charges
every tenant the tokens computed for it); a request whose KV is still coming up from a tier below (disk
reads, swap copies) is passed over until it landed, so the requests behind it are not held up. Requests
asking for prompt logprobs share at most `max_prompt_logprob_rows` scored prompt positions per step: their
prefill chunks are shortened to fit (chunked prefill disabled or not), which bounds the runner's
prompt-logprob arrays.
"""

from __future__ import annotations

import collections
import functools
import heapq

from jaxserve.config import SchedulerConfig, SpeculativeConfig
from jaxserve.core import spec_schedule
from jaxserve.core.fairness import FairWaitingQueue
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.preemption import PreemptionCost
from jaxserve.core.sched_types import (MAX_PROMPT_LOGPROB_ROWS, NewRequestData, RunnerOutput,
                                       ScheduledRequest, SchedulerOutput, StepUpdates)
from jaxserve.request import Request, RequestStatus


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
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 max_prompt_logprob_rows: int = MAX_PROMPT_LOGPROB_ROWS, first_row: int = 0,
                 speculative: SpeculativeConfig | None = None, preemption_cost: PreemptionCost | None = None,
                 device_guesses: bool = False):
        """`max_prompt_logprob_rows`: prompt positions one step may score for prompt_logprobs (the
        runner's bound); prefill chunks of requests asking for them are shortened to fit. The runner rows
        it assigns are first_row .. first_row + max_num_seqs - 1 (several schedulers feeding one runner,
        core/sharded_scheduler.py, each get their own). `speculative` (enabled): decode rows carry n-gram
        or draft-model guesses (sched_types: draft_token_ids); rows behind a verify step take guesses made
        on device with a draft model, and with n-grams when `device_guesses` (the runner proposes them on
        device too). `preemption_cost`: the rates preemption_mode auto compares."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled, so long prompts could never be scheduled; "
                f"enable chunked prefill or raise max_num_batched_tokens")
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.max_prompt_logprob_rows = max_prompt_logprob_rows
        self.requests: dict[str, Request] = {}
        self._fair = config.policy == "fair"
        self.waiting = FairWaitingQueue() if self._fair else WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # runner state to drop at the next step
        self._free_rows = list(range(first_row + config.max_num_seqs - 1, first_row - 1, -1))
        # Per scheduled step not yet updated: the requests that sample, in the step's sampling order, their
        # preemption counts then, the guesses of rows that had any (sampling index -> guesses), and the
        # sampling indices whose drafts (a draft model's, made during the step) are kept.
        self._in_flight: dict[int, tuple[list[Request], list[int], dict[int, list[int]], set[int]]] = {}
        self.step_count = 0
        self.num_preemptions = 0
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        self.device_guessing = self.speculative is not None and (self.speculative.uses_model or device_guesses)
        # a draft model guesses during each step: rows it drafts for get its KV slots (spec_schedule.lookahead)
        self._lookahead = (functools.partial(spec_schedule.lookahead, spec=speculative, max_model_len=max_model_len)
                           if self.speculative is not None and speculative.uses_model else None)
        # request id -> (row, blocks kept): block tables cut after a speculative step, sent with the next step
        self._truncated: dict[str, tuple[int, int]] = {}
        # Speculative decoding's counters (vLLM's spec_decode_*): steps of a request with guesses, the
        # guesses scored, of those accepted, and per guess position j the drafts whose guess j was accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.num_deferred = 0  # plain tokens scheduled right behind their row's verify step (spec_schedule.may_defer)
        self.num_device_guessed = 0  # device-guessed rows scheduled (spec_schedule.device_guesses)
        if config.preemption_mode == "swap" and not kv_cache.can_swap:
            raise ValueError("scheduler.preemption_mode=swap copies preempted requests' KV blocks to the host tier; "
                             "set cache.host_kv_gib > 0, or use preemption_mode auto or recompute")
        self._swap = config.preemption_mode != "recompute" and kv_cache.can_swap
        self.preemption_cost = preemption_cost or PreemptionCost()

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        params = request.sampling_params
        request.token_limit = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        request.stop_ids = frozenset(params.stop_token_ids or ()) | frozenset(
            () if params.ignore_eos else request.eos_token_ids)
        request.min_stop_len = request.num_prompt_tokens + params.min_tokens
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

    def _release_row(self, request: Request) -> None:
        if request.row >= 0:
            self._free_rows.append(request.row)
            request.row = -1
        request.num_pending = 0
        request.draft_token_ids = []
        request.next_guesses = 0
        request.proposal = None
        self._truncated.pop(request.request_id, None)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._release_row(request)
        self.kv_cache.free(request)
        if self._swap:
            self.kv_cache.drop_swap(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_row(request)
        if self._swap:
            self._swap_out(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_ids.add(request.request_id)
        self.waiting.push(request, front=True)

    def _swap_out(self, request: Request) -> bool:
        """Preemption by swap, where the mode (auto: the cost) asks for it and the host tier has room. The
        tokens kept exclude the last known one, computed again on resuming for its logits (a token sampled
        by a step in flight is dropped, as for recompute). Requests asking for prompt logprobs recompute."""
        keep = min(request.num_computed_tokens, request.num_tokens - 1)
        if keep <= 0 or request.sampling_params.prompt_logprobs is not None:
            return False
        if self.config.preemption_mode == "auto":
            num_blocks = -(-keep // self.kv_cache.block_size)
            recompute = keep - self.kv_cache.shared_prefix_tokens(request)
            if not self.preemption_cost.prefer_swap(num_blocks, self.kv_cache.block_bytes, recompute):
                return False
        return self.kv_cache.swap_out(request, keep)

    @staticmethod
    def _fit_prompt_rows(request: Request, computed: int, num_new: int, rows_left: int) -> tuple[int, int]:
        """(num_new, rows it scores): the chunk of a request asking for prompt logprobs shortened so that
        the prompt positions it scores (every one but the prompt's last) fit the step's `rows_left`."""
        if request.sampling_params.prompt_logprobs is None:
            return num_new, 0
        scored = max(0, min(computed + num_new, request.num_prompt_tokens - 1) - computed)
        return (num_new, scored) if scored <= rows_left else (rows_left, rows_left)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        self._make_room_for_priority_arrival()
        # n-gram proposals, made the first time a row could take guesses (a full batch never pays for them):
        # each row's depends on its own tokens only, which nothing earlier in this loop changes.
        proposals: dict[str, list[int]] | None = None
        # Each guess is one more logits row of the runner, which has max_num_seqs of them: guesses take
        # rows no running request holds, and admitted requests what is left.
        num_guesses = 0
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        allocate = self.kv_cache.allocate_slots
        # Plain decode rows (one token each, sampled), as columns; a decode row's bookkeeping is done as
        # it is scheduled (this loop runs for every running request every step).
        decode: list[Request] = []
        decode_positions: list[int] = []
        # Blocks appended to decode rows (each row every block_size steps): request id -> (decode index, ids).
        decode_blocks: dict[str, tuple[int, list[int]]] = {}
        scheduled: list[tuple[Request, ScheduledRequest]] = []
        preempted = False
        prompt_rows_left = self.max_prompt_logprob_rows
        drafting: set[str] = set()  # requests given the slots of a draft model's lookahead this step
        deferred: set[str] = set()  # decode rows right behind their own verify step (SchedulerOutput.deferred_decode)
        may_defer = self.speculative is not None and not self.speculative.uses_model
        lookahead = self._lookahead

        # Running requests first, in order (over a copy: preemption takes requests out of `running`).
        running = self.running
        append_decode, append_position = decode.append, decode_positions.append
        fast_until = self.kv_cache.fast_until
        for request in list(running):
            if budget <= 0:
                break
            if preempted and request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.draft_token_ids:  # its verify step is in flight: how many guesses it keeps is not known
                if self.device_guessing and (item := spec_schedule.device_guessed_row(
                        self, request, budget, self.config.max_num_seqs - len(running) - num_guesses, drafting)):
                    scheduled.append((request, item))
                    num_guesses += item.device_guesses
                    budget -= item.num_new_tokens
                    continue
                if not (may_defer and spec_schedule.may_defer(request, self.max_model_len)):
                    continue
                # One plain token right behind it, at the position of "none accepted" (the runner adds the
                # count on device), with a slot for "all accepted"; the update of the verify step rolls
                # num_computed_tokens back past the rejected guesses, this token included.
                new_blocks = allocate(request, 1)
                if new_blocks is None:
                    continue
                if new_blocks:
                    decode_blocks[request.request_id] = (len(decode), new_blocks)
                deferred.add(request.request_id)
                self.num_deferred += 1
                append_decode(request)
                append_position(request.num_computed_tokens - len(request.draft_token_ids))
                request.num_computed_tokens += 1
                request.num_pending += 1
                budget -= 1
                continue
            computed = request.num_computed_tokens
            known = len(request.all_token_ids) + request.num_pending
            remaining = known - computed
            guesses = None
            if (self.speculative is not None and budget > 1 and threshold != 1
                    and (guess_rows := self.config.max_num_seqs - len(running) - num_guesses) > 0):
                if proposals is None:
                    proposals = spec_schedule.propose(self.running, self.speculative)
                guesses = proposals.get(request.request_id)
            if guesses:
                guesses = guesses[:min(budget - 1, guess_rows, (threshold or budget) - 1)]
                extra = lookahead(request, computed + 1 + len(guesses)) if lookahead else 0
                # No room for the guesses: the row goes on without them (before anything is preempted).
                new_blocks = allocate(request, 1 + len(guesses) + extra)
                if new_blocks is not None:
                    if extra:
                        drafting.add(request.request_id)
                    request.draft_token_ids = guesses
                    num_guesses += len(guesses)
                    scheduled.append((request, ScheduledRequest(request.request_id, request.row, computed,
                                                                1 + len(guesses), new_blocks,
                                                                draft_token_ids=guesses)))
                    budget -= 1 + len(guesses)
                    continue
            extra = lookahead(request, computed + 1) if lookahead and remaining == 1 else 0
            if remaining == 1 and computed + extra < fast_until.get(request.request_id, 0):  # hot path: room
                if request.num_pending and known >= request.token_limit:
                    continue  # its pending token ends it (length): nothing more to compute
                if extra:
                    drafting.add(request.request_id)
                append_decode(request)
                append_position(computed)
                request.num_computed_tokens = computed + 1
                request.num_pending += 1
                budget -= 1
                continue
            if request.num_pending and known >= request.token_limit:
                continue
            num_new = min(remaining, budget)
            if 0 < threshold < num_new:
                num_new = threshold
            num_new, prompt_rows = self._fit_prompt_rows(request, computed, num_new, prompt_rows_left)
            if num_new <= 0:
                continue
            extra = lookahead(request, computed + num_new) if lookahead else 0
            new_blocks = allocate(request, num_new + extra) if extra else None
            if new_blocks is not None:
                drafting.add(request.request_id)
            while new_blocks is None and (new_blocks := allocate(request, num_new)) is None:
                victim = max(reversed(running), key=_victim_key)  # ties: the latest scheduled
                preempted = True
                # Taken out of this step again if it was scheduled; the KV cache manager uncaches its
                # blocks that this step would have written, so no later prefix hit reads them unwritten.
                budget += self._unschedule(victim, decode, decode_positions, decode_blocks, scheduled)
                self._preempt(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue  # `request` itself was preempted
            prompt_rows_left -= prompt_rows
            if remaining == 1:
                if new_blocks:
                    decode_blocks[request.request_id] = (len(decode), new_blocks)
                decode.append(request)
                decode_positions.append(computed)
                request.num_computed_tokens = computed + 1
                request.num_pending += 1
            else:
                scheduled.append((request, ScheduledRequest(request.request_id, request.row, computed, num_new,
                                                            new_blocks)))
            budget -= num_new

        # Then waiting requests, unless this step had to preempt.
        held: list[Request] = []
        while (not preempted and self.waiting and budget > 0
               and len(self.running) + num_guesses < self.config.max_num_seqs):
            request = self.waiting.peek()
            # As vLLM, a request asking for prompt logprobs takes no prefix-cache hit: they need every
            # prompt position computed (its blocks are still cached for others).
            lookup = request.sampling_params.prompt_logprobs is None
            swapped = self.kv_cache.swapped_tokens(request) if self._swap else 0  # resumes from host
            if swapped and not self.kv_cache.swap_ready(request) or (
                    not swapped and lookup and self.kv_cache.loading_prefix(request)):
                # Its blocks are on their way to the host (swap copies, disk reads): it waits aside, and the
                # requests behind it may start meanwhile.
                held.append(self.waiting.pop())
                continue
            computed_ids, num_hit = (([], swapped) if swapped else
                                     self.kv_cache.get_computed_blocks(request) if lookup else ([], 0))
            if not self.config.enable_chunked_prefill and request.num_tokens - num_hit > budget:
                break
            request.num_computed_tokens = num_hit
            num_new, prompt_rows = self._fit_prompt_rows(request, num_hit, self._num_new_tokens(request, budget),
                                                         prompt_rows_left)
            if num_new <= 0:
                new_blocks = None
            elif swapped:
                new_blocks = self.kv_cache.swap_in(request, num_new)
            else:
                extra = lookahead(request, num_hit + num_new) if lookahead else 0
                new_blocks = allocate(request, num_new + extra, computed_ids) if extra else None
                if new_blocks is not None:
                    drafting.add(request.request_id)
                else:
                    new_blocks = allocate(request, num_new, computed_ids)
            if new_blocks is None:
                request.num_computed_tokens = 0
                break
            prompt_rows_left -= prompt_rows
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.row = self._free_rows.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            scheduled.append((request, ScheduledRequest(
                request.request_id, request.row, num_hit, num_new, new_blocks,
                new=NewRequestData(list(request.all_token_ids), request.num_prompt_tokens, request.sampling_params,
                                   request.seed, request.eos_token_ids, request.max_tokens))))
            budget -= num_new
        for request in reversed(held):  # back in their places (FCFS: at the front, in order)
            self.waiting.push(request, front=True)

        if self._fair:  # service is charged as it is given: every token computed this step
            charge = self.waiting.charge
            for request in decode:
                charge(request.tenant, 1)
            for request, item in scheduled:
                charge(request.tenant, item.num_new_tokens)
        sampled = list(decode)
        step_guesses: dict[int, list[int]] = {}  # sampling index -> the row's guesses
        for request, item in scheduled:
            request.num_computed_tokens += item.num_new_tokens
            # A row with guesses computes past its known tokens (the guesses) and always samples (so does a
            # device-guessed row, whose count assumes every guess in flight kept).
            item.samples = item.device_guesses > 0 or (request.num_computed_tokens - len(item.draft_token_ids or ())
                                                       == len(request.all_token_ids) + request.num_pending)
            if item.samples:
                request.num_pending += 1
                if item.draft_token_ids or item.device_guesses:  # (device guesses: the runner reports them)
                    step_guesses[len(sampled)] = item.draft_token_ids or [-1] * item.device_guesses
                sampled.append(request)
        decode_new_blocks = [(i, block_id) for i, block_ids in decode_blocks.values() for block_id in block_ids]
        finished, self._finished_ids = self._finished_ids, set()
        truncated = list(self._truncated.values()) if self._truncated else []
        self._truncated.clear()
        self.step_count += 1
        if sampled:
            # With each request, its preemption count: a request preempted and re-admitted before this
            # step's tokens come back (the priority policy can do both in one schedule() call) must not
            # take them.
            self._in_flight[self.step_count] = (sampled, [request.num_preemptions for request in sampled], step_guesses,
                                                {i for i, r in enumerate(sampled) if r.request_id in drafting})
        return SchedulerOutput([request.request_id for request in decode], [request.row for request in decode],
                               decode_positions, decode_new_blocks, [item for _, item in scheduled],
                               self.config.max_num_batched_tokens - budget, finished, self.step_count, truncated,
                               [i for i, request in enumerate(decode) if request.request_id in deferred]
                               if deferred else [])

    @staticmethod
    def _unschedule(victim: Request, decode: list[Request], decode_positions: list[int],
                    decode_blocks: dict[str, tuple[int, list[int]]],
                    scheduled: list[tuple[Request, ScheduledRequest]]) -> int:
        """Takes a request back out of the step being built; returns the tokens it had."""
        for i, request in enumerate(decode):
            if request is victim:
                del decode[i], decode_positions[i]
                decode_blocks.pop(victim.request_id, None)
                for request_id, (index, block_ids) in decode_blocks.items():
                    if index > i:  # the rows after it moved up one
                        decode_blocks[request_id] = (index - 1, block_ids)
                victim.num_computed_tokens -= 1  # not computed after all (the KV manager's free() reads it)
                return 1
        for i, (request, item) in enumerate(scheduled):
            if request is victim:
                del scheduled[i]
                return item.num_new_tokens
        return 0

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

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> StepUpdates:
        """Appends one step's sampled tokens (in the step's sampling order) and finishes requests that stop.

        With overlap the next step was scheduled already: a request that finishes here had one more
        token in flight, which is dropped when it arrives (the request is no longer running).
        """
        sampled, epochs, step_guesses, drafting = self._in_flight.pop(scheduler_output.step,
                                                                      ([], [], {}, set()))
        tokens = runner_output.sampled_token_ids
        if len(tokens) != len(sampled):
            raise ValueError(f"step {scheduler_output.step} sampled {len(sampled)} requests but the runner returned "
                             f"{len(tokens)} tokens")
        requests, kept_tokens, finished, runs, run_logprobs = [], [], {}, {}, {}
        logprobs = runner_output.logprobs
        kept_logprobs = [] if logprobs is not None else None
        num_accepted = runner_output.num_accepted
        drafts = runner_output.draft_token_ids if drafting else None
        running_status = RequestStatus.RUNNING
        for i, (request, token, epoch) in enumerate(zip(sampled, tokens, epochs)):
            if request.status != running_status or request.num_preemptions != epoch:
                continue  # finished or preempted since it was scheduled: the token is dropped
            request.num_pending -= 1
            all_tokens = request.all_token_ids
            if step_guesses and i in step_guesses:
                if num_accepted is None:
                    raise ValueError(f"step {scheduler_output.step} scheduled guesses for {request.request_id!r} "
                                     f"but the runner returned no num_accepted")
                # (a device-guessed row's: the runner reports them, at most those scheduled; accept() checks)
                guesses = (runner_output.device_guesses or {}).get(i, step_guesses[i])[:len(step_guesses[i])]
                run, status, stop_reason = spec_schedule.accept(request, guesses, token, num_accepted[i],
                                                                len(step_guesses[i]))
                self.num_drafts += bool(guesses)
                self.num_draft_tokens += len(guesses)
                self.num_accepted_tokens += num_accepted[i]
                spec_schedule.count_accepted(self.accepted_per_position, len(guesses), num_accepted[i])
                # (a device-guessed step in flight keeps a draft model's lookahead slots past its tokens)
                lookahead_slots = (self.speculative.num_speculative_tokens
                                   if request.draft_token_ids and self._lookahead is not None else 0)
                if status is None and (kept := self.kv_cache.trim(request, lookahead_slots)) is not None:
                    self._truncated[request.request_id] = (request.row, kept)  # rejected guesses' blocks
                if drafts is not None and i in drafting:
                    spec_schedule.keep_proposal(request, drafts[i])
                requests.append(request)
                kept_tokens.append(run[-1])
                if len(run) > 1:
                    runs[len(requests) - 1] = run
                if kept_logprobs is not None:
                    # per token of the run (cut with it): the accepted guesses', then the token's
                    run_lps = ((runner_output.guess_logprobs or {}).get(i, []) + [logprobs[i]])[:len(run)]
                    kept_logprobs.append(run_lps[-1])
                    if len(run) > 1 and run_lps[-1] is not None:
                        run_logprobs[len(requests) - 1] = run_lps
                if status is not None:
                    request.stop_reason = stop_reason
                    self.running.remove(request)
                    self._finish(request, status)
                    finished[request.request_id] = (status, stop_reason)
                continue
            all_tokens.append(token)
            requests.append(request)
            kept_tokens.append(token)
            if drafts is not None and i in drafting:
                spec_schedule.keep_proposal(request, drafts[i])
            if kept_logprobs is not None:
                kept_logprobs.append(logprobs[i])
            # Stop checks (inlined: this loop runs for every running request every step). Length first, as
            # vLLM: an eos that is also the max_tokens-th token finishes with "length".
            num_tokens = len(all_tokens)
            if num_tokens >= request.token_limit:
                status, stop_reason = RequestStatus.FINISHED_LENGTH, None
            elif token in request.stop_ids and num_tokens >= request.min_stop_len:
                status = RequestStatus.FINISHED_STOPPED
                # A stop_token_id reports itself as the stop reason; eos reports none.
                stop_reason = token if token not in request.eos_token_ids or request.sampling_params.ignore_eos else None
            else:
                continue
            request.stop_reason = stop_reason
            self.running.remove(request)
            self._finish(request, status)
            finished[request.request_id] = (status, stop_reason)
        return StepUpdates(requests, kept_tokens, kept_logprobs, finished, runs, run_logprobs)
