"""The scheduler tests' harness: a fake runner that keeps the runner's side of the contract in
`sched_types.py` (per-request state added on `new`, dropped on `finished_request_ids`, append-only
block tables) and models the KV cache contents: each slot it writes holds (cache_salt, token prefix),
and every position a scheduled request attends to must hold that request's own (salt, prefix). So a
prefix-cache hit on a block whose K/V was never written, or a block reused while still in use, fails.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

from jaxserve.config import SchedulerConfig, SpeculativeConfig
from jaxserve.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from jaxserve.core.sched_types import RunnerOutput, SchedulerOutput
from jaxserve.core.sched_types import RequestUpdate
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

SEED = b"\x05" * 32
EOS = 2
STOP_ID = 5
TOKEN = 7  # a token that stops nothing


def token_at(request_id: str, tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the request and its position."""
    return 10 + (zlib.crc32(request_id.encode()) + 3 * len(tokens)) % 50


# ---------------------------------------------------------------- fake runner


@dataclasses.dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    last_guesses: int = 0  # guesses of the row's last verify step
    drafts: list[int] = dataclasses.field(default_factory=list)  # a draft model's guesses from its last step


class FakeRunner:
    """The runner's side of the contract, with a model of what each KV slot holds."""

    def __init__(self, scheduler: Scheduler, token_fn=token_at):
        self.scheduler = scheduler
        self.kv = scheduler.kv_cache
        self.block_size = self.kv.block_size
        self.token_fn = token_fn
        self.states: dict[str, _RunnerState] = {}
        self.slots: dict[int, tuple] = {}  # slot -> (salt, tuple(token prefix through that position))
        self.row_owner: dict[int, str] = {}
        self.num_accepted = 0  # guesses accepted, over every step

    def _slot(self, state: _RunnerState, position: int) -> int:
        block_id = state.block_ids[position // self.block_size]
        assert block_id != NULL_BLOCK_ID, "a request's block table holds the null block"
        return block_id * self.block_size + position % self.block_size

    @staticmethod
    def _content(state: _RunnerState, position: int) -> tuple:
        return state.cache_salt, tuple(state.token_ids[: position + 1])

    def execute(self, out: SchedulerOutput, tokens=None) -> RunnerOutput:
        """Runs one step; `tokens` (a list) gives the model's tokens in order (cycled; a row with guesses
        takes one per position it verifies), else token_fn decides."""
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        for row, num_blocks in out.truncated_block_tables:
            state = self.states[self.row_owner[row]]
            assert num_blocks * self.block_size >= state.num_computed_tokens, "a cut dropped a computed slot"
            del state.block_ids[num_blocks:]
        rows = out.all_rows()
        assert len({item.request_id for item in rows}) == len(rows), "a request scheduled twice"
        assert len({item.row for item in rows}) == len(rows), "two requests share a runner row"
        assert out.num_scheduled_tokens == sum(item.num_new_tokens for item in rows)
        steps = []
        deferred = set(out.deferred_decode)
        device_guesses = {}  # index into steps -> a device-guessed row's guesses
        for index, item in enumerate(rows):
            request = self.scheduler.requests[item.request_id]
            assert item.row == request.row and 0 <= item.row < self.scheduler.config.max_num_seqs
            if item.new is not None:
                self.row_owner[item.row] = item.request_id
            assert self.row_owner.get(item.row) == item.request_id, f"row {item.row} changed owner without `new`"
            state = self.states.get(item.request_id)
            if state is None:
                assert item.new is not None, f"{item.request_id}: runner has no state but `new` is not set"
                assert item.new.all_token_ids == request.all_token_ids
                assert item.new.num_prompt_tokens == request.num_prompt_tokens
                assert item.num_computed_tokens % self.block_size == 0, "prefix hits are whole blocks"
                state = _RunnerState(list(item.new.all_token_ids), [], item.num_computed_tokens, request.cache_salt)
                self.states[item.request_id] = state
            else:
                assert item.new is None, f"{item.request_id}: `new` sent again without a preemption"
                if index in deferred or item.device_guesses:  # behind its verify step, at "none accepted";
                    # the runner adds the count that step kept (this runner ran it already). (Deferred rows
                    # are decode rows, which lead; a device-guessed row's guesses are that step's drafts.)
                    kept = state.num_computed_tokens - item.num_computed_tokens
                    assert 0 <= kept <= state.last_guesses, (item, state)
                    assert item.num_new_tokens == 1 + item.device_guesses, item
                    assert item.device_guesses <= len(state.drafts), (item, state)
                    item = dataclasses.replace(item, num_computed_tokens=state.num_computed_tokens,
                                               draft_token_ids=state.drafts[:item.device_guesses] or None)
                    if item.device_guesses:
                        device_guesses[len(steps)] = item.draft_token_ids
                assert item.num_computed_tokens == state.num_computed_tokens, (
                    f"{item.request_id}: scheduled from position {item.num_computed_tokens}, runner is at "
                    f"{state.num_computed_tokens}")
            state.block_ids += item.new_block_ids
            num_known = len(state.token_ids)
            if item.draft_token_ids:  # the guesses are the row's inputs after its last known token
                assert item.samples and item.num_computed_tokens == num_known - 1
                assert item.num_new_tokens == 1 + len(item.draft_token_ids)
                state.token_ids = state.token_ids + list(item.draft_token_ids)
                state.last_guesses = len(item.draft_token_ids)
            assert state.block_ids == self.kv.get_block_ids(item.request_id), "block table is not append-only"
            end = item.num_computed_tokens + item.num_new_tokens
            assert item.num_new_tokens >= 1
            assert end <= len(state.token_ids), "scheduled past the known tokens"
            assert len(state.block_ids) * self.block_size >= end, "too few blocks for the step's tokens"
            assert item.samples == (end == len(state.token_ids))
            steps.append((item, state, end, num_known))
        for item, state, end, _ in steps:  # every K/V write of the step lands before any read (as in the model)
            for position in range(item.num_computed_tokens, end):
                self.slots[self._slot(state, position)] = self._content(state, position)
        for item, state, end, _ in steps:
            for position in range(end):
                held = self.slots.get(self._slot(state, position))
                assert held == self._content(state, position), (
                    f"{item.request_id} reads position {position} from block "
                    f"{state.block_ids[position // self.block_size]}, which holds "
                    f"{'nothing (never written)' if held is None else 'another sequence'}")
            state.num_computed_tokens = end
        request_ids, sampled, num_accepted = [], [], []
        drawn = iter(tokens * (1 + self.scheduler.config.max_num_batched_tokens)) if tokens else None

        def model(request_id, token_ids):
            return next(drawn) if drawn is not None else self.token_fn(request_id, token_ids)

        reported = {}  # sampling index -> a device-guessed row's guesses
        for step_index, (item, state, _, num_known) in enumerate(steps):
            if step_index in device_guesses:
                reported[len(sampled)] = device_guesses[step_index]
            if item.draft_token_ids:  # greedy verification: guesses are kept while the model agrees
                del state.token_ids[num_known:]
                accepted = 0
                for guess in item.draft_token_ids:
                    token = model(item.request_id, state.token_ids)
                    if token != guess:
                        break  # `token`, the model's own, replaces the rejected guess
                    state.token_ids.append(guess)
                    accepted += 1
                else:
                    token = model(item.request_id, state.token_ids)  # the bonus token after every guess
                state.num_computed_tokens = num_known + accepted
                state.token_ids.append(token)
                self.num_accepted += accepted
            elif item.samples:
                token = tokens[len(sampled) % len(tokens)] if tokens else self.token_fn(item.request_id,
                                                                                           state.token_ids)
                state.token_ids.append(token)
                accepted = 0
            else:
                continue
            request_ids.append(item.request_id)
            sampled.append(token)
            num_accepted.append(accepted)
        spec = any(item.draft_token_ids for item, *_ in steps)
        return RunnerOutput(request_ids, sampled, num_accepted=num_accepted if spec else None,
                            device_guesses=reported or None)


# ---------------------------------------------------------------- helpers


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128, caching: bool = True,
                   max_prompt_logprob_rows: int = 512, speculative: SpeculativeConfig | None = None,
                   **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, hash_seed=SEED)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len, max_prompt_logprob_rows=max_prompt_logprob_rows,
                     speculative=speculative)


_arrivals = itertools.count()
_prompt_starts = itertools.count(1000, 1000)  # int prompts never share a prefix by accident


def make_request(request_id: str, prompt, *, max_tokens: int = 8, priority: int = 0, arrival: float | None = None,
                 cache_salt: str | None = None, eos=(EOS,), **params) -> Request:
    if isinstance(prompt, int):
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt))
    prompt = list(prompt)
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos,
                   max_tokens=max_tokens, arrival_time=float(next(_arrivals) if arrival is None else arrival),
                   priority=priority, cache_salt=cache_salt)


class Driver:
    """Scheduler + fake runner; step() is what the engine does (non-overlap)."""

    def __init__(self, scheduler: Scheduler, token_fn=token_at):
        self.scheduler = scheduler
        self.runner = FakeRunner(scheduler, token_fn)
        self.outputs: list[SchedulerOutput] = []
        self.finished: dict[str, RequestUpdate] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        for item in out.all_rows():
            assert self.scheduler.requests[item.request_id].status == RequestStatus.RUNNING
        updates = self.scheduler.update_from_output(out, self.runner.execute(out))
        for update in updates:
            if update.finish_status is not None:
                assert update.request_id not in self.finished
                self.finished[update.request_id] = update
        self.outputs.append(out)
        return out

    def step_while(self, condition, max_steps: int = 50) -> SchedulerOutput | None:
        """Steps while condition() holds (at most max_steps); returns the last step's output."""
        out = None
        for _ in range(max_steps):
            if not condition():
                return out
            out = self.step()
        raise AssertionError(f"still {condition.__doc__ or 'going'} after {max_steps} steps: {self.scheduler.requests}")

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {self.scheduler.requests}")


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {item.request_id: item.num_new_tokens for item in out.all_rows()}


def item_of(out: SchedulerOutput, request_id: str):
    return next(item for item in out.all_rows() if item.request_id == request_id)
