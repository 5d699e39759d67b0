"""The contract between the scheduler and the model runner: plain dataclasses, no JAX.

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput
        -> Scheduler.update_from_output() -> StepUpdates (for the engine's output processing)

The scheduler sends only what changed: a request's sampling parameters and known tokens travel
once (`NewRequestData`, when it is first scheduled or resumed after preemption); later steps
carry only the step's positions and the block ids appended to its block table, so block tables
are append-only between (re)starts. Each running request owns a row (0 .. max_num_seqs - 1) that
the scheduler assigns when it starts and frees when it stops; the runner keeps per-row state and
resets a row whenever `new` arrives for it. Plain decode rows travel as columns (ids, rows,
positions), not one object each: at hundreds of running requests the per-request Python work of
the step is the host's cost.

With overlap scheduling, step N+1 is scheduled before step N's sampled tokens reach the host: a
request's token sampled at N is "pending" (Request.num_pending) and the runner feeds it to N+1
from the device.

Speculative decoding (n-gram): a decode row may carry guessed tokens (`draft_token_ids`) after its
input token (which may be pending: the runner feeds it from the device as for any decode row); the runner scores all 1 + k positions and returns
how many guesses it accepted plus one sampled token. The scheduler then rolls num_computed_tokens back
past the rejected positions and frees the blocks that only they used; the runner learns it from
`truncated_block_tables` of a later step (block tables are append-only between such cuts). Until the
step is processed the request's token count is unknown: under overlap the row takes one plain token in
the next step at the position of "no guess kept" (`deferred_decode`; the runner moves it on device); a
draft model's row sits that step out.

With a draft model (or EAGLE head) the guesses are made on the device during a step, from the token
the step samples: they come back as RunnerOutput.draft_token_ids and the next schedule makes them a
row's draft_token_ids. The scheduler allocates the KV slots the draft writes while guessing (positions up
to the step's last + k) with the row's other slots; the runner learns nothing more.
"""

from __future__ import annotations

import dataclasses

from jaxserve.request import Request, RequestStatus
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
    row: int  # the request's row in the runner's per-request arrays (assigned by the scheduler while running)
    num_computed_tokens: int  # tokens already in the cache; the position of this step's first token
    num_new_tokens: int  # tokens computed this step (a prefill chunk, or 1 for decode)
    new_block_ids: list[int]  # appended to the request's block table (all of them when `new` is set)
    new: NewRequestData | None = None  # set when the request (re)starts: the runner resets the row
    # True when this step reaches the end of the request's known tokens, so a token is sampled.
    samples: bool = True
    # Speculative verification: the guessed tokens fed after the request's last known token (positions
    # num_computed_tokens + 1 ..); num_new_tokens is 1 + len(draft_token_ids) and the row is scored at
    # every one of its positions. None: no guesses.
    draft_token_ids: list[int] | None = None
    # A device-guessed row (a draft model's or EAGLE head's, right behind its own verify step, still in
    # flight): its input token and its device_guesses guesses are that step's token and drafts, on device;
    # num_computed_tokens is its position if that step keeps none of its guesses, moved on device by the
    # count it keeps. num_new_tokens is 1 + device_guesses; draft_token_ids is None.
    device_guesses: int = 0


@dataclasses.dataclass
class SchedulerOutput:
    """One step. The batch holds the plain decode rows first (columns: one token each, always
    sampled), then `scheduled` (new or resumed requests, prefill chunks). Sampled tokens come back
    in that order: every decode row, then each `scheduled` item with `samples` set.
    """

    decode_ids: list[str]
    decode_rows: list[int]
    decode_positions: list[int]  # the position of the row's one token (= its num_computed_tokens)
    decode_new_blocks: list[tuple[int, int]]  # (index into the decode rows, block id) appended this step
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: set[str]  # finished, aborted or preempted since the last step
    step: int = 0
    # (row, number of blocks): cut that row's block table to that length before this step's appends (the
    # slots of rejected speculative positions, freed after the step that guessed them).
    truncated_block_tables: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Decode rows right behind their own verify step, still in flight (speculative decoding): indexes into
    # the decode rows. Their position is the one the row has if that step accepts none of its guesses; the
    # runner adds the number it accepts on device.
    deferred_decode: list[int] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.decode_rows

    @property
    def num_sampled(self) -> int:
        return len(self.decode_rows) + sum(item.samples for item in self.scheduled)

    def all_rows(self) -> list[ScheduledRequest]:
        """Every row of the batch, in batch order, decode rows expanded (for tests and debugging)."""
        new_blocks: dict[int, list[int]] = {}
        for index, block_id in self.decode_new_blocks:
            new_blocks.setdefault(index, []).append(block_id)
        decode = [ScheduledRequest(request_id, row, position, 1, new_blocks.get(index, []))
                  for index, (request_id, row, position) in
                  enumerate(zip(self.decode_ids, self.decode_rows, self.decode_positions))]
        return decode + self.scheduled


@dataclasses.dataclass(slots=True)
class Logprobs:
    """Log-probabilities (of the model's raw distribution) for one sampled position."""

    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


# The most prompt positions one step scores for prompt_logprobs (the runner's arrays for them hold this
# many rows at most, whatever the step's token count); the scheduler shortens such requests' prefill
# chunks to fit.
MAX_PROMPT_LOGPROB_ROWS = 512


@dataclasses.dataclass(slots=True)
class PromptLogprobs:
    """Prompt log-probabilities of one request's prefill chunk: entries `start` .. `start + n - 1` of its
    prompt_logprobs, entry i scoring prompt token i (`token_ids`) given the tokens before it."""

    request_id: str
    start: int  # >= 1: prompt token 0 has no entry
    token_ids: list[int]  # the prompt tokens scored
    logprobs: list[float]
    ranks: list[int]  # 1 = the most likely token
    top_token_ids: list[list[int]]  # per entry, the request's top-N
    top_logprobs: list[list[float]]


@dataclasses.dataclass
class RunnerOutput:
    request_ids: list[str]  # requests that sampled this step, in batch order
    sampled_token_ids: list[int]
    logprobs: list[Logprobs | None] | None = None  # per sampled request when any asked for logprobs
    prompt_logprobs: list[PromptLogprobs] | None = None  # the step's chunks of requests asking prompt_logprobs
    # Per sampled request, how many of its draft_token_ids were accepted (0 for a row without guesses);
    # None when the step had no guesses. The request's new tokens are its first num_accepted guesses, then
    # its sampled_token_ids entry (the correction or the bonus token).
    num_accepted: list[int] | None = None
    # sampling index -> Logprobs of its accepted guesses (requests asking logprobs that accepted any)
    guess_logprobs: dict[int, list[Logprobs]] | None = None
    # Per sampled request, the k tokens a draft model guesses for its next step (speculative.method draft_model
    # or eagle): after its new tokens of this step, the first stands for the token after them; None: no drafts.
    draft_token_ids: list[list[int]] | None = None
    # sampling index -> the guesses a device-guessed row (ScheduledRequest.device_guesses) was scored on: the
    # drafts of its previous step, which the host learns with that step's outputs.
    device_guesses: dict[int, list[int]] | None = None


@dataclasses.dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request (one item of StepUpdates)."""

    request_id: str
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None  # set when the request finished this step
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None


@dataclasses.dataclass(slots=True)
class StepUpdates:
    """What one step did, as columns (no object per request: this is built for every running request
    every step). Iterating gives RequestUpdate items."""

    requests: list[Request]  # requests that received a token, in sampling order
    tokens: list[int]  # each request's last new token
    logprobs: list[Logprobs | None] | None  # per request when any asked for logprobs
    finished: dict[str, tuple[RequestStatus, int | None]]  # request id -> (finish status, stop reason)
    # index into `requests` -> all its new tokens, for requests that got more than one (accepted guesses
    # of speculative decoding; the last is tokens[index])
    runs: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    run_logprobs: dict[int, list[Logprobs]] = dataclasses.field(default_factory=dict)  # per token of those runs

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        logprobs = self.logprobs or [None] * len(self.requests)
        for i, (request, token, token_logprobs) in enumerate(zip(self.requests, self.tokens, logprobs)):
            status, stop_reason = self.finished.get(request.request_id, (None, None))
            yield RequestUpdate(request.request_id, self.runs.get(i, [token]), status, stop_reason, token_logprobs)

    def __getitem__(self, index: int) -> RequestUpdate:
        return list(self)[index]
