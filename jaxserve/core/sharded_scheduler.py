"""One scheduler per expert shard behind the Scheduler interface (expert parallelism's data-parallel attention).

    add_request: the shard with the least load (the tokens its unfinished requests hold or will hold:
                 prompt + max_tokens, capped at max_model_len) -> that shard's Scheduler; request id -> shard
    schedule():  every shard's Scheduler.schedule() -> ShardedSchedulerOutput (one SchedulerOutput per shard)
    update_from_output(out, RunnerOutput): the runner's sampled tokens come back shard after shard (each
                 shard's in its own sampling order); split, each shard updated, StepUpdates concatenated
    finish / abort: to the request's shard

Each shard has its own KVCacheManager (block ids are local to the shard's cache) and its own runner rows
(Scheduler's first_row: shard s owns rows s * max_num_seqs ..), so one runner holds every shard's rows and
builds one step of shard-major sub-batches (runner/ep_runner.py). Overlap scheduling, preemption, chunked
prefill and prefix caching run inside each shard unchanged; a request never moves between shards.
Plain Python: no JAX.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxserve.core.kv_cache_manager import KVCacheManager, KVCacheStats
from jaxserve.core.sched_types import RunnerOutput, ScheduledRequest, SchedulerOutput
from jaxserve.core.sched_types import StepUpdates
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request, RequestStatus


@dataclasses.dataclass
class ShardedSchedulerOutput:
    """One step of every shard. The flat views (decode rows, scheduled items, counts) read as one
    SchedulerOutput's, shard after shard, which is also the order of the sampled tokens."""

    shards: list[SchedulerOutput]
    step: int

    @property
    def is_empty(self) -> bool:
        return all(out.is_empty for out in self.shards)

    @property
    def num_sampled(self) -> int:
        return sum(out.num_sampled for out in self.shards)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(out.num_scheduled_tokens for out in self.shards)

    @property
    def decode_ids(self) -> list[str]:
        return [request_id for out in self.shards for request_id in out.decode_ids]

    @property
    def decode_rows(self) -> list[int]:
        return [row for out in self.shards for row in out.decode_rows]

    @property
    def deferred_decode(self) -> list[int]:
        offsets = itertools.accumulate((len(out.decode_rows) for out in self.shards), initial=0)
        return [start + i for out, start in zip(self.shards, offsets) for i in out.deferred_decode]

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return [item for out in self.shards for item in out.scheduled]

    @property
    def finished_request_ids(self) -> set[str]:
        return set().union(*(out.finished_request_ids for out in self.shards))


class ShardedKVCache:
    """The shards' KV cache managers, read as one (engine statistics): usage is the mean, counts the sum."""

    def __init__(self, managers: list[KVCacheManager]):
        self.managers = managers

    @property
    def usage(self) -> float:
        return sum(m.usage for m in self.managers) / len(self.managers)

    @property
    def tier_usage(self) -> tuple[tuple[str, float], ...]:
        """Each tier's share in use, the shards' mean (each shard has its own tiers)."""
        usages = [m.tier_usage for m in self.managers]
        return tuple((tier, sum(u[i][1] for u in usages) / len(usages)) for i, (tier, _) in enumerate(usages[0]))

    @property
    def stats(self) -> KVCacheStats:
        stats = [m.stats for m in self.managers]
        return KVCacheStats(*(sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(KVCacheStats)))

    def reset_prefix_cache(self) -> bool:
        return all([m.reset_prefix_cache() for m in self.managers])


class ShardedScheduler:
    """Scheduler's interface (what the engine calls) over one Scheduler per expert shard."""

    def __init__(self, schedulers: list[Scheduler]):
        if len(schedulers) < 2:
            raise ValueError("a ShardedScheduler needs at least two shards (one shard is a plain Scheduler)")
        self.shards = schedulers
        self.loads = [0] * len(schedulers)  # tokens held or to be held by each shard's unfinished requests
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (shard, its load)
        self.step_count = 0

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        if request.request_id in self._owner:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.sampling_params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with parallel.expert > 1 yet; leave it unset")
        shard = min(range(len(self.shards)), key=lambda i: (self.loads[i], i))
        self.shards[shard].add_request(request)
        self._owner[request.request_id] = (shard, request.token_limit)
        self.loads[shard] += request.token_limit

    def shard_of(self, request_id: str) -> int | None:
        owner = self._owner.get(request_id)
        return owner[0] if owner is not None else None

    def _release(self, request_ids) -> None:
        for request_id in request_ids:
            owner = self._owner.pop(request_id, None)
            if owner is not None:
                self.loads[owner[0]] -= owner[1]

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            shard = self.shard_of(request_id)
            if shard is None:
                continue
            self.shards[shard].finish_requests(request_id, status)
            if request_id not in self.shards[shard].requests:
                self._release([request_id])

    def abort_requests(self, request_ids) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.shards)

    @property
    def running(self) -> list[Request]:
        return [request for s in self.shards for request in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [request for s in self.shards for request in s.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.shards)

    @property
    def num_drafts(self) -> int:
        return sum(s.num_drafts for s in self.shards)

    @property
    def accepted_per_position(self) -> list[int]:
        return list(map(sum, itertools.zip_longest(*(s.accepted_per_position for s in self.shards), fillvalue=0)))

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft_tokens for s in self.shards)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(s.num_accepted_tokens for s in self.shards)

    # ---- one step ----
    def schedule(self) -> ShardedSchedulerOutput:
        self.step_count += 1
        return ShardedSchedulerOutput([s.schedule() for s in self.shards], self.step_count)

    def update_from_output(self, out: ShardedSchedulerOutput, runner_output: RunnerOutput) -> StepUpdates:
        """Splits the runner's tokens (shard after shard, out.shards[i].num_sampled each) and updates each shard."""
        if len(runner_output.sampled_token_ids) != out.num_sampled:
            raise ValueError(f"step {out.step} sampled {out.num_sampled} requests over {len(self.shards)} shards but "
                             f"the runner returned {len(runner_output.sampled_token_ids)} tokens")
        merged = StepUpdates([], [], None, {})
        start = 0
        for scheduler, shard_out in zip(self.shards, out.shards):
            end = start + shard_out.num_sampled
            logprobs = runner_output.logprobs[start:end] if runner_output.logprobs is not None else None
            part = RunnerOutput(runner_output.request_ids[start:end], runner_output.sampled_token_ids[start:end],
                                logprobs)
            updates = scheduler.update_from_output(shard_out, part)
            if updates.logprobs is not None and merged.logprobs is None:
                merged.logprobs = [None] * len(merged.requests)
            if merged.logprobs is not None:
                merged.logprobs += updates.logprobs if updates.logprobs is not None else [None] * len(updates)
            merged.requests += updates.requests
            merged.tokens += updates.tokens
            merged.finished |= updates.finished
            start = end
        self._release(merged.finished)
        return merged
