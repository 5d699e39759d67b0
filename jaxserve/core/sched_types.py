"""The contract between the scheduler and the model runner: plain dataclasses, no JAX.

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput
        -> Scheduler.update_from_output()

The scheduler sends only what changed: a request's sampling parameters and known tokens travel
once (`NewRequestData`, when it is first scheduled or resumed after preemption); later steps
carry only the step's tokens and the block ids appended to its block table, so block tables are
append-only between (re)starts. The runner keeps its own per-request state keyed by request id
and drops it when the id appears in `finished_request_ids`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    all_token_ids: list[int]  # prompt + tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    max_tokens: int


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    num_computed_tokens: int  # tokens already in the cache; the position of this step's first token
    num_new_tokens: int  # tokens computed this step (a prefill chunk, or 1 for decode)
    new_block_ids: list[int]  # appended to the request's block table (all of them when `new` is set)
    new: NewRequestData | None = None  # set when the runner has no state for this request yet
    # True when this step reaches the end of the request's known tokens, so a token is sampled.
    samples: bool = True


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: set[str]  # finished, aborted or preempted since the last step
    step: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(slots=True)
class Logprobs:
    """Log-probabilities (of the model's raw distribution) for one sampled position."""

    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass
class RunnerOutput:
    request_ids: list[str]  # requests that sampled this step, in scheduled order
    sampled_token_ids: list[int]
    logprobs: list[Logprobs | None] | None = None  # per sampled request when any asked for logprobs
