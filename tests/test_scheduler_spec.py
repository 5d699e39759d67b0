"""Scheduler with n-gram speculative decoding: decode rows carry guesses, the budget and KV blocks count
them, rejected positions are rolled back (their blocks freed, never prefix-cached) and stops inside an
accepted run end it exactly there. Driven by the fake runner of tests/scheduler_harness.py, which
verifies guesses greedily against its deterministic 'model' and checks every K/V slot a request reads."""

from __future__ import annotations

import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.core.sched_types import SchedulerOutput
from tests.scheduler_harness import EOS, Driver, make_request, make_scheduler

pytestmark = pytest.mark.cpu_test

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
CYCLE = [21, 22, 23, 24, 25]


def cyclic(request_id: str, tokens: list[int]) -> int:
    """A 'model' that mostly continues a cycle (so n-gram guesses are often right) but breaks it every
    7th position (so some guesses are rejected)."""
    if len(tokens) % 7 == 0:
        return 30 + len(tokens) % 4
    return CYCLE[len(tokens) % len(CYCLE)]


def prompt(i: int, length: int = 9) -> list[int]:
    return [CYCLE[(i + j) % len(CYCLE)] for j in range(length)]


class OverlapDriver(Driver):
    """Driver with overlap scheduling: step N+1 is scheduled (and run) before step N's update."""

    def __init__(self, scheduler, token_fn=cyclic):
        super().__init__(scheduler, token_fn)
        self.in_flight = None

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        runner_output = self.runner.execute(out)  # an empty step still tells the runner what finished
        result = None if out.is_empty else (out, runner_output)
        previous, self.in_flight = self.in_flight, result
        if previous is not None:
            for update in self.scheduler.update_from_output(*previous):
                if update.finish_status is not None:
                    self.finished[update.request_id] = update
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and self.in_flight is None:
                return
            self.step()
        raise AssertionError(f"unfinished after {max_steps} steps: {self.scheduler.requests}")


def generate(speculative=None, overlap=False, num_blocks=64, prompts=None, max_tokens=20, **config):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, speculative=speculative, **config)
    driver = (OverlapDriver if overlap else Driver)(scheduler, cyclic)
    prompts = prompts or {f"r{i}": prompt(i) for i in range(4)}
    requests = [make_request(request_id, tokens, max_tokens=max_tokens, temperature=0.0) for request_id, tokens in prompts.items()]
    driver.add(*requests)
    driver.run()
    assert scheduler.kv_cache.num_free_blocks == num_blocks - 1  # nothing leaked, rejected tails included
    return driver, {request.request_id: request.output_token_ids for request in requests}


@pytest.mark.parametrize("overlap", [False, True])
def test_guesses_leave_outputs_unchanged_and_save_steps(overlap):
    plain_driver, plain = generate(overlap=overlap)
    driver, spec = generate(SPEC, overlap=overlap)
    assert spec == plain and all(len(tokens) == 20 for tokens in spec.values())
    scheduler = driver.scheduler
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens  # some guesses right, some wrong
    assert scheduler.num_accepted_tokens == driver.runner.num_accepted
    assert len(driver.outputs) < len(plain_driver.outputs)
    rows = [item for out in driver.outputs for item in out.scheduled if item.draft_token_ids]
    assert rows and all(item.num_new_tokens == 1 + len(item.draft_token_ids) <= 4 for item in rows)
    # Rejected tails were freed and the runner told (the fake runner applies and checks each cut).
    assert any(out.truncated_block_tables for out in driver.outputs)


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_overlap_row_takes_a_token_right_behind_its_verify_step(temperature):
    """Under overlap a row whose verify step is in flight takes one plain token in the next step, at the
    position of "no guess kept" (the runner moves it; the fake runner checks the move stays within the
    guesses). Outputs equal those without guesses."""
    def run(speculative):
        scheduler = make_scheduler(num_blocks=64, block_size=4, speculative=speculative)
        driver = OverlapDriver(scheduler, cyclic)
        request = make_request("a", prompt(0), max_tokens=12, temperature=temperature, seed=1)
        driver.add(request)
        driver.run()
        assert scheduler.kv_cache.num_free_blocks == 63
        return driver, request.output_token_ids

    driver, outputs = run(SPEC)
    rows = [{item.request_id: item for item in out.all_rows()} for out in driver.outputs]
    behind = [step for step, items in enumerate(rows[:-1]) if "a" in items and items["a"].draft_token_ids]
    assert len(behind) > 1 and all("a" in rows[step + 1] and not rows[step + 1]["a"].draft_token_ids
                                   and driver.outputs[step + 1].deferred_decode == [0] for step in behind[:-1])
    assert driver.scheduler.num_deferred >= len(behind) - 1
    assert outputs == run(None)[1]


def test_budget_counts_guesses_and_caps_them():
    scheduler = make_scheduler(block_size=4, speculative=SPEC, max_num_batched_tokens=6)
    driver = Driver(scheduler, cyclic)
    requests = [make_request("a", prompt(0, 6), max_tokens=10, temperature=0.0),
                make_request("b", prompt(1, 6), max_tokens=10, temperature=0.0)]
    driver.add(*requests)
    driver.run()
    rows = [item for out in driver.outputs for item in out.all_rows()]
    assert any(item.draft_token_ids for item in rows)
    assert all(out.num_scheduled_tokens <= 6 for out in driver.outputs)
    # Two decode rows in a budget of 6: guesses fill what the other row leaves (6 - 1 - 1 = 4 > k = 3 is
    # never reached, 2 guesses each or 3 + 1 ...), and a lone row gets at most budget - 1 guesses.
    for out in driver.outputs:
        assert sum(item.num_new_tokens for item in out.all_rows()) == out.num_scheduled_tokens
    _, plain = generate(prompts={"a": prompt(0, 6), "b": prompt(1, 6)}, max_tokens=10, max_num_batched_tokens=6)
    assert {request.request_id: request.output_token_ids for request in requests} == plain
    tight = make_scheduler(block_size=4, speculative=SPEC, max_num_batched_tokens=2)
    driver = Driver(tight, cyclic)
    driver.add(make_request("c", prompt(0, 6), max_tokens=10, temperature=0.0))
    driver.run()
    rows = [item for out in driver.outputs for item in out.all_rows() if item.draft_token_ids]
    assert rows and all(len(item.draft_token_ids) == 1 for item in rows)


def test_guesses_never_pass_max_tokens_or_the_model_length():
    for max_tokens in (1, 2, 5, 11):
        _, plain = generate(max_tokens=max_tokens)
        driver, spec = generate(SPEC, max_tokens=max_tokens)
        assert spec == plain and all(len(tokens) == max_tokens for tokens in spec.values())
    _, plain = generate(max_tokens=200, max_model_len=40)
    driver, spec = generate(SPEC, max_tokens=200, max_model_len=40)
    assert spec == plain and all(len(tokens) == 40 - 9 for tokens in spec.values())


def test_eos_inside_an_accepted_run_ends_it_there():
    cycle = [21, 22, 23, EOS, 24]

    def with_eos(request_id, tokens):  # the cycle holds eos: guesses run through it
        return cycle[len(tokens) % 5]

    for ignore_eos in (False, True):
        outputs = []
        for speculative in (None, SPEC):
            driver = Driver(make_scheduler(block_size=4, speculative=speculative), with_eos)
            request = make_request("a", cycle * 2, max_tokens=9, ignore_eos=ignore_eos, temperature=0.0)
            driver.add(request)
            driver.run()
            outputs.append((request.output_token_ids, request.status, driver.finished["a"].new_token_ids))
        assert outputs[0][:2] == outputs[1][:2]
        tokens, _, last_update = outputs[1]
        assert tokens == ([21, 22, 23, EOS] if not ignore_eos else (cycle * 2)[:9])
        if not ignore_eos:  # the step after the prompt guessed [22, 23, eos]: one update, cut at the eos
            assert last_update == [22, 23, EOS]


def test_preemption_and_prefix_caching_with_guesses():
    prompts = {f"r{i}": prompt(i % 2, 9 + 4 * (i % 3)) for i in range(6)}  # shared prefixes
    _, plain = generate(prompts=prompts, max_tokens=16)
    for overlap in (False, True):
        driver, tight = generate(SPEC, overlap=overlap, num_blocks=1 + 10, prompts=prompts, max_tokens=16)
        assert driver.scheduler.num_preemptions > 0 and driver.scheduler.num_accepted_tokens > 0
        assert tight == plain
    # A later request whose prompt is an earlier one's tokens hits only blocks written with those tokens
    # (the fake runner checks every slot it reads: a cached rejected guess would fail it).
    scheduler = make_scheduler(block_size=4, speculative=SPEC)
    driver = Driver(scheduler, cyclic)
    first = make_request("first", prompt(0), max_tokens=20, temperature=0.0)
    driver.add(first)
    driver.run()
    second = make_request("second", first.all_token_ids, max_tokens=8, temperature=0.0)
    driver.add(second)
    driver.run()
    assert second.num_cached_tokens >= 20


def test_every_row_guesses_and_guesses_fit_the_logits_rows():
    """Random sampling, logprobs, penalties and min_tokens do not keep a row from guessing (the runner
    samples each guessed position with its own output token's metadata)."""
    scheduler = make_scheduler(block_size=4, speculative=SPEC, max_num_seqs=7)
    driver = Driver(scheduler, cyclic)
    greedy = dict(max_tokens=20, temperature=0.0)
    requests = [make_request("greedy", prompt(0), **greedy), make_request("random", prompt(0), max_tokens=20),
                make_request("logprobs", prompt(0), logprobs=1, **greedy),
                make_request("penalty", prompt(0), repetition_penalty=1.2, **greedy),
                make_request("min", prompt(0), min_tokens=4, **greedy)]
    driver.add(*requests)
    driver.run()
    guessed = {item.request_id for out in driver.outputs for item in out.scheduled if item.draft_token_ids}
    assert guessed == {request.request_id for request in requests}
    for out in driver.outputs:
        guesses = sum(len(item.draft_token_ids or ()) for item in out.scheduled)
        assert out.num_sampled + guesses <= 7
    assert all(request.num_output_tokens == 20 for request in requests)
