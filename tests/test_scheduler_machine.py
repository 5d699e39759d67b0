"""The scheduler as a Hypothesis state machine: random arrivals, steps with random tokens (eos included),
aborts and preemptions under random configs (block size, budget, chunking, policy, overlap, n-gram
speculation); the block pool's and the fake runner's invariants are checked after every rule
(tests/scheduler_harness.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.config import SchedulerConfig, SpeculativeConfig
from jaxserve.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from jaxserve.core.sched_types import RunnerOutput, SchedulerOutput
from jaxserve.core.sched_types import RequestUpdate
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from tests.scheduler_harness import EOS, FakeRunner, SEED, STOP_ID, TOKEN

pytestmark = pytest.mark.cpu_test


VOCAB = (EOS, STOP_ID, 3, 4, 6, TOKEN, TOKEN, TOKEN, TOKEN)  # stops in 2 of 9 draws
BASES = ([3, 4, 3, 3, 4, 4, 3, 4] * 5, [4, 4, 3, 3] * 10)


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.sampled_from([44, 52]))
    min_blocks = -(-max_model_len // block_size)  # any request fits alone
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 24)) if chunked else draw(st.integers(max_model_len, max_model_len + 8))
    return dict(
        block_size=block_size,
        num_blocks=1 + min_blocks + draw(st.integers(0, 4)),
        max_model_len=max_model_len,
        caching=draw(st.booleans()),
        config=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, 5)),
                               enable_chunked_prefill=chunked,
                               long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
                               policy=draw(st.sampled_from(["fcfs", "priority", "fair"]))),
        overlap=draw(st.booleans()),
        speculative=draw(st.one_of(st.none(), st.builds(
            lambda k, high: SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                                              prompt_lookup_max=high),
            st.integers(1, 3), st.integers(1, 3)))),
    )


@st.composite
def prompts(draw):
    base = draw(st.sampled_from(BASES))
    shared = base[: draw(st.integers(0, 40))]
    tail = draw(st.lists(st.sampled_from([3, 4]), max_size=12))
    prompt = (shared + tail)[:40]
    return prompt or [3]


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps with random tokens (eos included) and aborts; invariants after every rule."""

    @initialize(setup=configs())
    def setup(self, setup):
        self.kv = KVCacheManager(setup["num_blocks"], setup["block_size"], enable_caching=setup["caching"],
                                 hash_seed=SEED)
        self.scheduler = Scheduler(setup["config"], self.kv, setup["max_model_len"],
                                   speculative=setup["speculative"])
        self.config = setup["config"]
        self.runner = FakeRunner(self.scheduler)
        self.added: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}  # tokens reported in updates
        self.finish_events: dict[str, list[RequestStatus]] = {}
        self.next_id = 0
        self.clock = 0  # arrival times
        # Overlap scheduling: step N+1 is scheduled (and run) before step N's tokens are given back.
        self.overlap = setup["overlap"]
        self.in_flight: tuple[SchedulerOutput, RunnerOutput, dict[str, int]] | None = None

    # ---- rules ----
    @rule(specs=st.lists(st.fixed_dictionaries(dict(
        prompt=prompts(), max_tokens=st.integers(1, 12), priority=st.integers(0, 2),
        salt=st.sampled_from([None, "s"]), ignore_eos=st.booleans(), stop=st.booleans(),
        min_tokens=st.integers(0, 3), tenant=st.sampled_from([None, "a", "b"]))), min_size=1, max_size=3),
        siblings=st.booleans())
    def add_requests(self, specs, siblings):
        """siblings: like the children of an n > 1 request (same prompt, arrival time, priority, salt)."""
        for spec in specs:
            if siblings:
                spec = dict(specs[0], max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
            else:
                self.clock += 1
            self._add(**spec, arrival=self.clock)
        self.clock += 1

    def _add(self, prompt, max_tokens, priority, salt, ignore_eos, stop, min_tokens, tenant, arrival):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0,
                                stop_token_ids=[STOP_ID] if stop else None, min_tokens=min(min_tokens, max_tokens))
        request = Request(request_id, prompt, params, eos_token_ids=(EOS,), max_tokens=max_tokens,
                          arrival_time=float(arrival), priority=priority, cache_salt=salt, tenant=tenant)
        self.scheduler.add_request(request)
        self.added[request_id] = request
        self.outputs[request_id] = []
        self.finish_events[request_id] = []

    @rule(tokens=st.lists(st.sampled_from(VOCAB), min_size=5, max_size=5))
    def step(self, tokens):
        self._step(tokens)

    @rule(index=st.integers(0, 1000))
    def abort(self, index):
        live = sorted(self.scheduler.requests)
        if not live:
            return
        request_id = live[index % len(live)]
        self.scheduler.abort_requests([request_id])
        assert self.added[request_id].status == RequestStatus.FINISHED_ABORTED
        self.finish_events[request_id].append(RequestStatus.FINISHED_ABORTED)

    def drain(self):
        """Steps until every request has finished, then checks each finished once. No livelock: each
        step computes >= 1 token (checked in _step), and some request samples a token (or finishes)
        at least every `patience` steps: the highest-ranked running request is never preempted while
        it has company, so it reaches the end of its known tokens within that many steps."""
        rng = random.Random(self.next_id)
        work = sum(r.num_tokens + r.max_tokens for r in self.scheduler.requests.values())
        steps_left = 3 * work + 10
        idle_steps = 0
        while self.scheduler.has_unfinished_requests() or self.in_flight:
            patience = sum(r.num_tokens for r in self.scheduler.requests.values()) + 10
            idle_steps = 0 if self._step([rng.choice(VOCAB)]) else idle_steps + 1
            steps_left -= 1
            assert idle_steps < patience and steps_left > 0, f"no progress: {self.scheduler.requests}"
        for request_id, events in self.finish_events.items():
            assert len(events) == 1, f"{request_id} finished {len(events)} times: {events}"

    def teardown(self):
        if hasattr(self, "scheduler"):
            self.drain()
            num_preemptions = self.scheduler.num_preemptions
            event(f"preemptions: {'3+' if num_preemptions >= 3 else num_preemptions}")
            event(f"prefix hits: {self.kv.stats.hits > 0}")
            event(f"overlap: {self.overlap}")
            event(f"guesses accepted: {self.scheduler.num_accepted_tokens > 0}")
            assert not self.scheduler._in_flight, "a step's sampled requests were never given back"

    def _step(self, tokens):
        scheduler = self.scheduler
        had_work = scheduler.has_unfinished_requests()
        # (With overlap, running requests may all be waiting for the pending token that ends them.)
        ends_pending = self.in_flight is not None and any(r.num_pending for r in scheduler.running)
        out = scheduler.schedule()
        if had_work and not ends_pending:
            assert not out.is_empty, "unfinished requests but nothing scheduled (each fits alone)"
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(out.all_rows()) <= self.config.max_num_seqs
        for item in out.all_rows():
            request = scheduler.requests[item.request_id]
            assert request.status == RequestStatus.RUNNING and request in scheduler.running
            if self.config.long_prefill_token_threshold:
                assert item.num_new_tokens <= self.config.long_prefill_token_threshold
        runner_output = self.runner.execute(out, tokens)
        # Each sampling request's preemption count when the step was scheduled: one preempted and readmitted
        # since (the priority policy can do both in one schedule() call) must not take the step's token.
        epochs = {request_id: scheduler.requests[request_id].num_preemptions
                  for request_id in runner_output.request_ids}
        if self.overlap:
            (out, runner_output, epochs), self.in_flight = self.in_flight or (None, None, None), (
                None if out.is_empty else (out, runner_output, epochs))
            if out is None:
                return 1 if self.in_flight else 0
        live = [request_id for request_id in runner_output.request_ids
                if request_id in scheduler.requests and scheduler.requests[request_id].status == RequestStatus.RUNNING
                and scheduler.requests[request_id].num_preemptions == epochs[request_id]]
        if not self.overlap:
            assert live == runner_output.request_ids
        updates = scheduler.update_from_output(out, runner_output)
        assert [u.request_id for u in updates] == live  # nothing dropped without cause
        for update in updates:
            request = self.added[update.request_id]
            assert not self.finish_events[update.request_id], f"update for finished {update.request_id}"
            for token in update.new_token_ids[:-1]:  # a run of accepted guesses: no stop before its end
                self.outputs[update.request_id].append(token)
                assert not self._should_stop(request), f"{request} ran past a stop in {update.new_token_ids}"
            self.outputs[update.request_id].append(update.new_token_ids[-1])
            self._check_finish(request, update)
        return len(updates)

    def _stops(self, request: Request) -> tuple[bool, bool]:
        """(may stop by token, at length) after the tokens reported so far."""
        params = request.sampling_params
        output = self.outputs[request.request_id]
        last = output[-1]
        may_stop = len(output) >= params.min_tokens and (
            (not params.ignore_eos and last in request.eos_token_ids) or last in params.stop_token_ids)
        at_length = (len(output) >= request.max_tokens
                     or request.num_prompt_tokens + len(output) >= self.scheduler.max_model_len)
        return may_stop, at_length

    def _should_stop(self, request: Request) -> bool:
        return any(self._stops(request))

    def _check_finish(self, request: Request, update: RequestUpdate):
        params = request.sampling_params
        output = self.outputs[request.request_id]
        last = output[-1]
        may_stop, at_length = self._stops(request)
        assert len(output) <= request.max_tokens
        assert request.num_tokens <= self.scheduler.max_model_len
        if update.finish_status is None:
            assert not may_stop and not at_length, f"{request} should have finished after {output}"
            return
        self.finish_events[request.request_id].append(update.finish_status)
        assert request.status == update.finish_status
        if update.finish_status == RequestStatus.FINISHED_STOPPED:
            assert may_stop
            assert update.stop_reason == (last if last in params.stop_token_ids and not (
                not params.ignore_eos and last in request.eos_token_ids) else None)
        else:
            assert update.finish_status == RequestStatus.FINISHED_LENGTH and at_length

    # ---- invariants ----
    @invariant()
    def requests_and_queues_agree(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        running, waiting = list(scheduler.running), list(scheduler.waiting)
        assert len(running) <= self.config.max_num_seqs
        assert len({id(r) for r in running + waiting}) == len(running) + len(waiting)
        assert {r.request_id for r in running + waiting} == set(scheduler.requests)
        assert all(r.status == RequestStatus.RUNNING for r in running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
        for request_id, request in self.added.items():
            live = request_id in scheduler.requests
            assert live == (not request.is_finished) == (not self.finish_events[request_id])
            assert len(self.finish_events[request_id]) <= 1
            assert request.output_token_ids == self.outputs[request_id]  # preemption keeps tokens, none lost
            assert request.num_output_tokens <= request.max_tokens
            block_ids = self.kv.get_block_ids(request_id)
            if not live:
                assert block_ids == []
                continue
            guesses = len(request.draft_token_ids)  # of a speculative step in flight
            assert request.num_computed_tokens <= request.num_tokens + request.num_pending + guesses
            assert request.num_pending >= 0
            state = self.runner.states.get(request_id)
            if request.status == RequestStatus.RUNNING and state is not None:
                # The runner knows every token the scheduler has, and with overlap the pending ones too.
                assert state.token_ids[:request.num_tokens] == request.all_token_ids
                # (a step in flight with guesses adds 1 + its accepted guesses)
                assert 0 <= len(state.token_ids) - request.num_tokens - request.num_pending <= guesses
            assert len(block_ids) * self.kv.block_size >= request.num_computed_tokens
            if request.status != RequestStatus.RUNNING:
                assert block_ids == [] and request.num_computed_tokens == 0

    @invariant()
    def no_block_is_leaked(self):
        if not hasattr(self, "scheduler"):
            return
        pool = self.kv.pool
        holders: dict[int, int] = {}
        for request_id in self.scheduler.requests:
            block_ids = self.kv.get_block_ids(request_id)
            assert len(set(block_ids)) == len(block_ids)
            for block_id in block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        assert NULL_BLOCK_ID not in holders and pool.null_block.ref_cnt == 0
        free = [block.block_id for block in pool.free_queue]
        assert len(free) == len(set(free)) == pool.num_free_blocks
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert set(free) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        assert len(free) + len(holders) == pool.num_blocks - 1


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
