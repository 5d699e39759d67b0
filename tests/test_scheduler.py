"""Scheduler: chunked prefill, mixed batches, budgets, preemption, priorities, stops, prefix cache.

The scheduler is driven by a fake runner that keeps the runner's side of the contract in
`sched_types.py` (per-request state added on `new`, dropped on `finished_request_ids`, append-only
block tables) and models the KV cache contents: each slot it writes holds (cache_salt, token prefix),
and every position a scheduled request attends to must hold that request's own (salt, prefix). So a
prefix-cache hit on a block whose K/V was never written, or a block reused while still in use, fails.
"""

from __future__ import annotations

import random

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_types import RunnerOutput, SchedulerOutput
from jaxserve.core.sched_types import RequestUpdate
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from tests.scheduler_harness import (
    Driver, EOS, FakeRunner, SEED, STOP_ID, TOKEN, item_of, make_request, make_scheduler, scheduled_tokens)

pytestmark = pytest.mark.cpu_test


# ---------------------------------------------------------------- chunked prefill and batches


def test_chunked_prefill_spreads_a_long_prompt_over_the_budget():
    driver = Driver(make_scheduler(max_num_batched_tokens=8))
    request = make_request("a", 30)
    driver.add(request)
    chunks, samples = [], []
    for _ in range(4):
        item = item_of(driver.step(), "a")
        assert item.num_computed_tokens == sum(chunks)
        chunks.append(item.num_new_tokens)
        samples.append(item.samples)
    assert chunks == [8, 8, 8, 6] and sum(chunks) == 30
    assert samples == [False, False, False, True]  # only the chunk that reaches the end samples
    assert request.num_computed_tokens == 30 and request.num_tokens == 31
    assert item_of(driver.step(), "a").num_new_tokens == 1  # then it decodes


def test_decode_rows_and_a_prefill_chunk_share_one_step():
    driver = Driver(make_scheduler(max_num_batched_tokens=10))
    driver.add(make_request("a", 3), make_request("b", 2))
    driver.step()  # both prefill whole
    driver.add(make_request("c", 40))
    out = driver.step()
    assert scheduled_tokens(out) == {"a": 1, "b": 1, "c": 8}
    assert [item.samples for item in out.all_rows()] == [True, True, False]
    assert out.num_scheduled_tokens == 10


def test_running_requests_are_scheduled_before_waiting_ones():
    driver = Driver(make_scheduler(max_num_batched_tokens=4))
    driver.add(make_request("a", 3), make_request("b", 9))
    out = driver.step()
    assert scheduled_tokens(out) == {"a": 3, "b": 1}
    driver.add(make_request("c", 2))  # arrives while b is mid-prefill
    out = driver.step()
    # a's decode and b's next chunk first; c (waiting) only gets what is left, here nothing.
    assert [item.request_id for item in out.all_rows()] == ["a", "b"]
    assert scheduled_tokens(out) == {"a": 1, "b": 3}
    assert driver.scheduler.requests["c"].status == RequestStatus.WAITING


def test_max_num_seqs_and_max_num_batched_tokens_are_never_exceeded():
    scheduler = make_scheduler(max_num_batched_tokens=7, max_num_seqs=3)
    driver = Driver(scheduler)
    rng = random.Random(0)
    driver.add(*(make_request(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 6)) for i in range(12)))
    peak_seqs = peak_tokens = 0
    while scheduler.has_unfinished_requests():
        out = driver.step()
        assert len(scheduler.running) <= 3 and len(out.all_rows()) <= 3
        assert out.num_scheduled_tokens <= 7
        peak_seqs, peak_tokens = max(peak_seqs, len(out.all_rows())), max(peak_tokens, out.num_scheduled_tokens)
        assert len(driver.outputs) < 500
    assert (peak_seqs, peak_tokens) == (3, 7)  # the limits were reached, not just respected
    assert len(driver.finished) == 12


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits():
    driver = Driver(make_scheduler(max_num_batched_tokens=12, max_model_len=12, enable_chunked_prefill=False))
    driver.add(make_request("a", 4, max_tokens=3), make_request("a2", 3, max_tokens=3),
               make_request("b", 11, max_tokens=1), make_request("c", 1, max_tokens=1))
    out = driver.step()
    assert scheduled_tokens(out) == {"a": 4, "a2": 3}  # b needs 11 > 5 left; c waits behind it (FCFS)
    for _ in range(2):
        out = driver.step()
        assert scheduled_tokens(out) == {"a": 1, "a2": 1}  # 10 left < 11: b is never cut into chunks
    assert set(driver.finished) == {"a", "a2"}
    out = driver.step()
    assert scheduled_tokens(out) == {"b": 11, "c": 1}
    assert item_of(out, "b").samples


def test_long_prefill_token_threshold_caps_a_chunk():
    driver = Driver(make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=3))
    driver.add(make_request("a", 10), make_request("b", 2))
    chunks = [scheduled_tokens(driver.step())["a"] for _ in range(5)]
    assert chunks == [3, 3, 3, 1, 1]  # then decodes


@pytest.mark.parametrize("chunked", [True, False])
def test_prompt_positions_scored_per_step_fit_the_runner_rows(chunked):
    """Requests asking for prompt logprobs share max_prompt_logprob_rows scored positions per step (every
    prompt position but the last scores one), chunked prefill or not; plain requests fill the rest."""
    driver = Driver(make_scheduler(max_num_batched_tokens=32, max_prompt_logprob_rows=5, enable_chunked_prefill=chunked,
                                   max_model_len=32))
    driver.add(make_request("a", 12, prompt_logprobs=1), make_request("c", 20), make_request("b", 4, prompt_logprobs=0))
    assert scheduled_tokens(driver.step()) == {"a": 5, "c": 20}  # "b" waits: no row is left for it
    assert scheduled_tokens(driver.step()) == {"a": 5, "c": 1}
    assert scheduled_tokens(driver.step()) == {"a": 2, "c": 1, "b": 4}  # a scores 1 (its last scores none), b 3
    driver.run()
    assert set(driver.finished) == {"a", "b", "c"}


def test_non_chunked_config_with_budget_below_max_model_len_is_rejected():
    """A prompt that fits max_model_len but not max_num_batched_tokens would wait forever: such a config is
    refused up front, as vLLM does (max_num_batched_tokens >= max_model_len), naming both fixes."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) is smaller than max_model_len \(64\).*"
                                         r"enable chunked prefill or raise max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=64)
    make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64)  # equal is fine


# ---------------------------------------------------------------- preemption


def _fill_cache(policy="fcfs", priorities=(0, 0, 0), num_blocks=4, **config):
    """a (4 tokens), b and c (2 tokens each) fill three 4-token blocks; only a's first decode needs another."""
    driver = Driver(make_scheduler(num_blocks=num_blocks, block_size=4, policy=policy, **config))
    requests = [make_request(name, [20 + i] * length, max_tokens=6, priority=priority)
                for i, (name, length, priority) in enumerate(zip("abc", (4, 2, 2), priorities))]
    driver.add(*requests)
    out = driver.step()
    assert scheduled_tokens(out) == {"a": 4, "b": 2, "c": 2}
    assert driver.scheduler.kv_cache.num_free_blocks == num_blocks - 4
    return driver, requests


@pytest.mark.parametrize("priorities, victim", [((0, 0, 0), "c"), ((0, 5, 1), "b"), ((3, 1, 3), "c"),
                                                ((5, 0, 1), "a")])
def test_preemption_picks_the_lowest_priority_then_the_latest_arrival(priorities, victim):
    driver, requests = _fill_cache(priorities=priorities)
    scheduler = driver.scheduler
    late = make_request("d", 3)
    driver.add(late)
    request = scheduler.requests[victim]
    assert scheduler.kv_cache.get_block_ids(victim)
    out = driver.step()
    assert set(scheduled_tokens(out)) == set("abc") - {victim}
    assert out.finished_request_ids == {victim}  # the runner drops its state this very step
    assert request.status == RequestStatus.PREEMPTED and request.num_preemptions == 1
    assert request.num_computed_tokens == 0
    assert request.num_output_tokens == 1  # keeps what it generated
    assert scheduler.kv_cache.get_block_ids(victim) == []
    assert list(scheduler.waiting) == [request, late]  # front of the FCFS queue
    assert scheduler.num_preemptions == 1
    assert [r.request_id for r in scheduler.running] == [r.request_id for r in requests if r is not request]


def test_preempted_request_keeps_its_tokens_and_recomputes_them():
    driver, (a, b, c) = _fill_cache()
    generated = list(c.output_token_ids)
    driver.step()  # c preempted
    assert c.status == RequestStatus.PREEMPTED and c.output_token_ids == generated
    out = driver.step_while(lambda: c.status != RequestStatus.RUNNING)
    item = item_of(out, "c")
    assert item.new is not None and item.new.all_token_ids == c.prompt_token_ids + generated
    driver.run()
    assert c.num_output_tokens == 6 and c.output_token_ids[:1] == generated
    assert driver.finished["c"].finish_status == RequestStatus.FINISHED_LENGTH


def test_outputs_are_the_same_with_and_without_preemption():
    prompts = {f"r{i}": [30 + i % 2] * (3 + 5 * i) for i in range(5)}

    def run(num_blocks):
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12)
        driver = Driver(scheduler)
        requests = [make_request(rid, prompt, max_tokens=10) for rid, prompt in prompts.items()]
        driver.add(*requests)
        driver.run()
        assert scheduler.kv_cache.num_free_blocks == num_blocks - 1
        return scheduler.num_preemptions, {r.request_id: r.output_token_ids for r in requests}

    roomy_preemptions, roomy = run(64)
    tight_preemptions, tight = run(1 + 10)  # the longest request needs 8 blocks alone
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy
    assert all(len(tokens) == 10 for tokens in tight.values())


def test_siblings_with_equal_priority_and_arrival_do_not_preempt_each_other_forever():
    """The children of an n > 1 request share priority and arrival time. The victim among them must
    be chosen by a total order: if the earlier-scheduled one (the one further ahead) is preempted
    each time, they take turns losing their progress and neither finishes (no prefix cache here)."""
    scheduler = make_scheduler(num_blocks=1 + 12, block_size=4, max_model_len=48, caching=False,
                               long_prefill_token_threshold=4)
    driver = Driver(scheduler)
    prompt = list(range(50, 70))
    driver.add(*(make_request(f"{i}_x", prompt, max_tokens=20, arrival=1.0) for i in range(2)))
    driver.run(max_steps=200)  # each needs 10 of the 12 blocks: one at a time, about 50 steps
    assert sorted(driver.finished) == ["0_x", "1_x"]


def test_token_sampled_for_a_request_aborted_in_the_meantime_is_dropped():
    driver = Driver(make_scheduler())
    request = make_request("a", 5)
    driver.add(request)
    out = driver.scheduler.schedule()
    runner_output = driver.runner.execute(out)
    driver.scheduler.abort_requests("a")
    assert len(driver.scheduler.update_from_output(out, runner_output)) == 0
    assert request.num_output_tokens == 0 and request.status == RequestStatus.FINISHED_ABORTED
    assert driver.scheduler.schedule().finished_request_ids == {"a"}


def test_token_sampled_for_a_request_preempted_in_the_meantime_is_dropped():
    """Overlap order (schedule N+1 before reading N back): N+1 preempts a request that sampled in N."""
    scheduler = make_scheduler(num_blocks=1 + 2, block_size=4, long_prefill_token_threshold=4)
    runner = FakeRunner(scheduler)
    long, short = make_request("long", 8, max_tokens=1), make_request("short", 4, max_tokens=4)
    scheduler.add_request(long)
    scheduler.add_request(short)
    first = scheduler.schedule()
    assert scheduled_tokens(first) == {"long": 4, "short": 4} and item_of(first, "short").samples
    first_output = runner.execute(first)
    second = scheduler.schedule()  # long needs a second block: the later arrival is preempted
    assert "short" in second.finished_request_ids and short.status == RequestStatus.PREEMPTED
    updates = scheduler.update_from_output(first, first_output)
    assert list(updates) == [] and short.num_output_tokens == 0  # its token is dropped, not appended
    scheduler.update_from_output(second, runner.execute(second))
    driver = Driver(scheduler)
    driver.runner = runner
    driver.run()
    assert short.num_output_tokens == 4 and long.num_output_tokens == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_victim_is_the_lowest_priority_even_when_it_was_scheduled_first_and_no_unwritten_block_is_hit(policy):
    """`low` runs ahead of `high` in the running list. When `high` needs a block, `low` is the victim
    (docs/ARCHITECTURE.md §3.5), though its chunk was already allocated this step and its newly full blocks registered
    in the prefix cache: those are never written once it is unscheduled, so a later hit on them (by
    `low` itself on resumption) would read garbage. The fake runner checks every position read."""
    scheduler = make_scheduler(num_blocks=1 + 6, block_size=4, long_prefill_token_threshold=6, policy=policy)
    driver = Driver(scheduler)
    low = make_request("low", 18, max_tokens=2, priority=5)
    driver.add(low)
    driver.step()  # low: tokens 0..6
    high = make_request("high", 4, max_tokens=8, priority=0)
    driver.add(high)
    assert scheduled_tokens(driver.step()) == {"low": 6, "high": 4}
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    out = driver.step()  # low's chunk 12..18 and high's first decode block do not both fit
    assert high.num_preemptions == 0, "the high-priority request was preempted instead of the low-priority one"
    assert low.status == RequestStatus.PREEMPTED and "low" in out.finished_request_ids
    assert scheduled_tokens(out) == {"high": 1}
    driver.run()  # low resumes from the prefix cache; the fake runner checks what it reads was written
    assert low.num_output_tokens == 2 and high.num_output_tokens == 8


def test_a_victim_taken_out_of_the_step_never_leaves_a_same_step_prefix_hit_unwritten():
    """`w` hits block 2 of `victim` in the very step that allocates (and registers) it; when a
    higher-priority arrival then preempts `victim` out of the step, that block is never written, so
    `w` must not read it (the fake runner checks every position read was written for its reader)."""
    scheduler = make_scheduler(num_blocks=1 + 5, block_size=4, policy="priority", long_prefill_token_threshold=8)
    driver = Driver(scheduler)
    victim = make_request("victim", [3] * 4 + [4] * 4 + [5] * 4 + [6] * 4, max_tokens=1, priority=5)
    driver.add(victim)
    assert scheduled_tokens(driver.step()) == {"victim": 8}
    driver.add(make_request("w", [3] * 4 + [4] * 4 + [5] * 4 + [7], max_tokens=2, priority=1),
               make_request("high", [8] * 8, max_tokens=2, priority=3))
    driver.step()  # victim's 8..16 fills blocks 2, 3; w can hit blocks 0..2; high needs 2 blocks of the 1 left
    driver.run()
    assert victim.num_output_tokens == 1


def test_a_waiting_request_that_hit_its_victims_new_block_still_gets_scheduled():
    """`r` may hit block 2 of `victim`, registered by this very step, and need more blocks than are
    free; if `victim` is then preempted out of the step, the hit must stay valid (or be looked up
    again) instead of the allocation failing on an uncached block."""
    scheduler = make_scheduler(num_blocks=1 + 5, block_size=4, policy="priority", long_prefill_token_threshold=8)
    driver = Driver(scheduler)
    victim = make_request("victim", [3] * 4 + [4] * 4 + [5] * 4 + [6] * 4, max_tokens=1, priority=5)
    driver.add(victim)
    assert scheduled_tokens(driver.step()) == {"victim": 8}
    r = make_request("r", [3] * 4 + [4] * 4 + [5] * 4 + [7] * 4 + [8], max_tokens=2, priority=1)
    driver.add(r)
    out = driver.step()  # victim's 8..16 fills blocks 2, 3; r can hit blocks 0..2 and needs 2 more of the 1 left
    assert "r" in scheduled_tokens(out)
    driver.run()
    assert victim.num_output_tokens == 1 and r.num_output_tokens == 2


# ---------------------------------------------------------------- priorities


def test_priority_policy_orders_waiting_requests_by_priority_then_arrival():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    driver = Driver(scheduler)
    specs = [("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0), ("d", 1, 3.0), ("e", 0, 4.0)]
    driver.add(*(make_request(name, 2, max_tokens=1, priority=priority, arrival=arrival)
                 for name, priority, arrival in specs))
    driver.run(max_steps=20)
    order = [item.request_id for out in driver.outputs for item in out.all_rows() if item.new is not None]
    assert order == ["e", "b", "d", "c", "a"]


def test_fcfs_policy_ignores_priority_when_admitting():
    scheduler = make_scheduler(policy="fcfs", max_num_seqs=1)
    driver = Driver(scheduler)
    driver.add(make_request("a", 2, max_tokens=1, priority=3), make_request("b", 2, max_tokens=1, priority=0))
    assert [item.request_id for item in driver.step().all_rows()] == ["a"]


def test_high_priority_arrival_preempts_a_lower_priority_running_request():
    scheduler = make_scheduler(num_blocks=1 + 8, block_size=4, policy="priority")
    driver = Driver(scheduler)
    low = make_request("low", 8, max_tokens=20, priority=5)
    driver.add(low)
    driver.step_while(lambda: len(scheduler.kv_cache.get_block_ids("low")) < 6)
    high = make_request("high", 12, max_tokens=2, priority=0)  # needs 3 blocks, 2 are free
    driver.add(high)
    driver.step_while(lambda: high.status == RequestStatus.WAITING and not low.is_finished)
    assert not low.is_finished, "the high-priority request waited for the low-priority one to finish"
    assert low.num_preemptions == 1 and high.status == RequestStatus.RUNNING
    driver.run()
    assert high.num_output_tokens == 2 and low.num_output_tokens == 20


# ---------------------------------------------------------------- abort


def test_abort_running_request_frees_its_blocks():
    scheduler = make_scheduler(num_blocks=16, caching=False)
    driver = Driver(scheduler)
    driver.add(make_request("a", 10), make_request("b", 5))
    driver.step()
    assert scheduler.kv_cache.num_free_blocks == 15 - 3 - 2
    scheduler.abort_requests(["a"])
    assert scheduler.kv_cache.get_block_ids("a") == [] and scheduler.kv_cache.num_free_blocks == 15 - 2
    assert [r.request_id for r in scheduler.running] == ["b"]
    out = driver.step()
    assert out.finished_request_ids == {"a"} and scheduled_tokens(out) == {"b": 1}
    scheduler.abort_requests("b")
    assert scheduler.kv_cache.num_free_blocks == 15 and not scheduler.has_unfinished_requests()
    scheduler.abort_requests(["b", "unknown"])  # twice, or unknown: ignored


def test_abort_waiting_and_preempted_requests_frees_their_blocks():
    driver, (a, b, c) = _fill_cache()
    scheduler = driver.scheduler
    waiting = make_request("w", 8)
    driver.add(waiting)
    driver.step()  # c preempted; w waits
    assert c.status == RequestStatus.PREEMPTED and waiting.status == RequestStatus.WAITING
    scheduler.abort_requests(["c", "w"])
    assert c.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert len(scheduler.waiting) == 0 and set(scheduler.requests) == {"a", "b"}
    out = driver.step()
    assert {"c", "w"} <= out.finished_request_ids
    scheduler.abort_requests(["a", "b"])
    assert scheduler.kv_cache.num_free_blocks == 3
    for request_id in "abcw":
        assert scheduler.kv_cache.get_block_ids(request_id) == []


# ---------------------------------------------------------------- stop conditions


def _run_one(request: Request, tokens: list[int], max_model_len: int = 128) -> tuple[Driver, RequestUpdate]:
    script = iter(tokens)
    driver = Driver(make_scheduler(max_model_len=max_model_len), token_fn=lambda request_id, _: next(script))
    driver.add(request)
    driver.run()
    assert driver.scheduler.kv_cache.num_free_blocks == 63
    return driver, driver.finished[request.request_id]


def test_eos_stops_a_request():
    request = make_request("a", 3, max_tokens=10)
    _, update = _run_one(request, [TOKEN, TOKEN, EOS, TOKEN])
    assert request.output_token_ids == [TOKEN, TOKEN, EOS]
    assert update.finish_status == request.status == RequestStatus.FINISHED_STOPPED
    assert update.stop_reason is None and request.status.finish_reason == "stop"


def test_any_of_several_eos_ids_stops_and_ignore_eos_does_not():
    request = make_request("a", 3, max_tokens=10, eos=(EOS, 9))
    _run_one(request, [TOKEN, 9, TOKEN])
    assert request.output_token_ids == [TOKEN, 9]
    request = make_request("b", 3, max_tokens=4, ignore_eos=True)
    _, update = _run_one(request, [EOS, EOS, TOKEN, EOS, TOKEN])
    assert request.output_token_ids == [EOS, EOS, TOKEN, EOS]
    assert update.finish_status == RequestStatus.FINISHED_LENGTH


def test_stop_token_id_stops_with_its_id_as_stop_reason():
    request = make_request("a", 3, max_tokens=10, stop_token_ids=[STOP_ID, 6], ignore_eos=True)
    _, update = _run_one(request, [EOS, 6, TOKEN])
    assert request.output_token_ids == [EOS, 6]
    assert update.finish_status == RequestStatus.FINISHED_STOPPED and update.stop_reason == 6
    assert request.stop_reason == 6


def test_min_tokens_holds_back_eos_and_stop_ids():
    request = make_request("a", 3, max_tokens=10, min_tokens=3, stop_token_ids=[STOP_ID])
    _, update = _run_one(request, [EOS, STOP_ID, EOS, TOKEN])
    assert request.output_token_ids == [EOS, STOP_ID, EOS]  # the third token may stop
    assert update.finish_status == RequestStatus.FINISHED_STOPPED
    request = make_request("b", 3, max_tokens=10, min_tokens=3, stop_token_ids=[STOP_ID])
    _, update = _run_one(request, [EOS, TOKEN, STOP_ID, TOKEN])
    assert update.finish_status == RequestStatus.FINISHED_STOPPED and update.stop_reason == STOP_ID


def test_max_tokens_and_max_model_len_end_with_length():
    request = make_request("a", 3, max_tokens=4)
    driver, update = _run_one(request, [TOKEN] * 10)
    assert request.num_output_tokens == 4 and update.finish_status == RequestStatus.FINISHED_LENGTH
    assert update.stop_reason is None and request.status.finish_reason == "length"
    # Each step's update carries exactly the new token.
    request = make_request("b", 10, max_tokens=50)
    _, update = _run_one(request, [TOKEN] * 20, max_model_len=16)
    assert request.num_tokens == 16 and update.finish_status == RequestStatus.FINISHED_LENGTH


def test_updates_carry_each_new_token_once_and_finish_once():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    request = make_request("a", 6, max_tokens=3)
    scheduler.add_request(request)
    seen = []
    for _ in range(4):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        updates = scheduler.update_from_output(out, runner.execute(out))
        assert [u.request_id for u in updates] == ["a"]
        seen += updates[0].new_token_ids
        assert (updates[0].finish_status is not None) == (len(seen) == 3)
    assert seen == request.output_token_ids
    assert scheduler.schedule().finished_request_ids == {"a"}


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_hit_starts_a_second_request_past_the_shared_blocks():
    scheduler = make_scheduler(block_size=4)
    driver = Driver(scheduler)
    prompt = list(range(40, 50))  # 10 tokens: 2 full blocks
    driver.add(make_request("a", prompt, max_tokens=5))
    driver.step()
    second = make_request("b", prompt, max_tokens=2)
    driver.add(second)
    item = item_of(driver.step(), "b")
    assert item.num_computed_tokens == 8 and item.num_new_tokens == 2 and item.samples
    assert second.num_cached_tokens == 8
    assert scheduler.kv_cache.get_block_ids("a")[:2] == scheduler.kv_cache.get_block_ids("b")[:2]
    driver.run()
    third = make_request("c", prompt + [1, 2], max_tokens=1)  # after both finished: the blocks are free but cached
    driver.add(third)
    assert item_of(driver.step(), "c").num_computed_tokens == 8


def test_prefix_cache_never_covers_all_tokens():
    driver = Driver(make_scheduler(block_size=4))
    prompt = list(range(40, 48))  # exactly 2 full blocks
    driver.add(make_request("a", prompt, max_tokens=1))
    driver.run()
    driver.add(make_request("b", prompt, max_tokens=1))
    item = item_of(driver.step(), "b")
    assert item.num_computed_tokens == 4 and item.num_new_tokens == 4  # the last token is computed for logits


def test_prefix_cache_respects_cache_salt():
    driver = Driver(make_scheduler(block_size=4))
    prompt = list(range(40, 50))
    driver.add(make_request("a", prompt, max_tokens=1, cache_salt="x"))
    driver.run()
    driver.add(make_request("b", prompt, max_tokens=1), make_request("c", prompt, max_tokens=1, cache_salt="y"),
               make_request("d", prompt, max_tokens=1, cache_salt="x"))
    out = driver.step()
    assert {item.request_id: item.num_computed_tokens for item in out.all_rows()} == {"b": 0, "c": 0, "d": 8}


def test_preempted_request_resumes_from_its_cached_prefix():
    scheduler = make_scheduler(num_blocks=1 + 4, block_size=4)
    driver = Driver(scheduler)
    a, c = make_request("a", 4, max_tokens=3), make_request("c", 9, max_tokens=2)
    driver.add(a, c)
    driver.step()  # a: 1 block, c: 2 full blocks + 1 partial; none left
    out = driver.step()  # a's decode needs a block: c is preempted, a takes c's partial (freed first)
    assert out.finished_request_ids == {"c"} and c.num_cached_tokens == 0
    for _ in range(10):
        out = driver.step()
        if "c" in scheduled_tokens(out):
            break
    item = item_of(out, "c")
    assert item.new is not None and (item.num_computed_tokens, item.num_new_tokens) == (8, 2)
    driver.run()
    assert c.num_output_tokens == 2 and a.num_output_tokens == 3




def test_overlap_token_of_a_request_preempted_and_readmitted_in_one_schedule_is_dropped():
    """Priority policy with overlap: step N is in flight when a higher-priority arrival preempts V, and
    the same schedule() re-admits V (a prefix hit on its own freed blocks) for step N+1. V's token
    from step N belongs to its previous run and must be dropped, or V gets two tokens for one position."""
    kv = KVCacheManager(10, 4, hash_seed=SEED)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, policy="priority",
                                          long_prefill_token_threshold=8), kv, 64)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    victim = Request("V", list(range(100, 114)), params, priority=5, arrival_time=0.0, max_tokens=20)
    scheduler.add_request(victim)

    def run(out: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput([], [42] * out.num_sampled)

    for _ in range(2):  # prefill in two chunks of 8 (then one sampled token)
        out = scheduler.schedule()
        scheduler.update_from_output(out, run(out))
    in_flight = scheduler.schedule()  # step N: a decode row for V, not read back yet
    assert in_flight.decode_ids == ["V"] and victim.num_pending == 1
    scheduler.add_request(Request("H", list(range(200, 240)), params, priority=0, arrival_time=1.0, max_tokens=20))
    next_step = scheduler.schedule()  # step N+1: H preempts V; V comes back in the same call
    assert victim.num_preemptions == 1 and victim.status == RequestStatus.RUNNING
    assert [u.request_id for u in scheduler.update_from_output(in_flight, run(in_flight))] == []
    scheduler.update_from_output(next_step, run(next_step))
    assert victim.num_pending == 0
    assert victim.num_tokens == victim.num_computed_tokens + 1  # one token per computed position, no duplicate
