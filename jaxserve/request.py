"""A request inside the engine and its status state machine (host-only; no JAX).

    WAITING --schedule--> RUNNING --finish--> FINISHED_{STOPPED,LENGTH,ABORTED}
       ^                     |
       +------preempt--------+   (PREEMPTED waits again, keeps its generated tokens, recomputes)

A request with SamplingParams.n > 1 is fanned out by the engine into n child Requests that share
the prompt (and its KV blocks, through the prefix cache); each child is scheduled on its own.
"""

from __future__ import annotations

import enum
import time

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Every status from here on is final.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence to generate. `num_computed_tokens` counts tokens whose K/V is in the cache."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "max_tokens", "arrival_time",
                 "priority", "cache_salt", "lora_id", "seed", "tenant", "status", "all_token_ids",
                 "num_computed_tokens", "num_pending", "row", "token_limit", "stop_ids", "min_stop_len",
                 "num_cached_tokens", "num_preemptions", "stop_reason", "draft_token_ids",
                 "proposal", "next_guesses")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int | None = None,  # resolved max_tokens (params.max_tokens or what fits in max_model_len)
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        seed: int = 0,
        tenant: str | None = None,  # who sent it (server: a header or the API key), for fair sharing  # resolved sampling seed (params.seed, or one drawn by the engine)
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.seed = seed
        self.tenant = tenant

        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens sampled by steps in flight, not yet in all_token_ids (overlap)
        self.row = -1  # the runner row it holds while running (assigned by the scheduler)
        # Set by the scheduler when the request is added, for its per-token stop checks:
        self.token_limit = 0  # prompt + max_tokens, capped at max_model_len
        self.stop_ids: frozenset[int] = frozenset()  # eos (unless ignore_eos) and stop_token_ids
        self.min_stop_len = 0  # no stop by token before this many tokens (prompt + min_tokens)
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.draft_token_ids: list[int] = []  # guesses of its speculative step in flight ([]: none)
        # the guesses of a device-guessed step scheduled right behind that one (0: none; Scheduler.schedule)
        self.next_guesses = 0
        # A draft model's guesses from its last step: (the token index the first guess stands for, guesses)
        self.proposal: tuple[int, list[int]] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __lt__(self, other: Request) -> bool:  # priority order: lower priority value, then earlier arrival
        return (self.priority, self.arrival_time, self.request_id) < (other.priority, other.arrival_time,
                                                                      other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
