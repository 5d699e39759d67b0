"""FairWaitingQueue (virtual token counters per tenant): shares, the lift on re-backlog, front pushes,
removal, and drop-in use by the scheduler's policy "fair". Host-only: no JAX."""

from __future__ import annotations

import collections
import itertools

import pytest

from jaxserve.core.fairness import FairWaitingQueue
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.cpu_test

_clock = itertools.count()


def make(tenant: str | None, name: str | None = None, num_prompt: int = 4) -> Request:
    tick = next(_clock)
    return Request(name or f"{tenant}-{tick}", [1] * num_prompt, SamplingParams(max_tokens=4),
                   arrival_time=float(tick), tenant=tenant)


def serve(queue: FairWaitingQueue, cost: int) -> Request:
    """Pop the next request and charge its tenant `cost` tokens, as the scheduler does on admission."""
    request = queue.pop()
    queue.charge(request.tenant, cost)
    return request


def test_fifo_within_one_tenant():
    queue = FairWaitingQueue()
    requests = [make("a") for _ in range(5)]
    for request in requests:
        queue.push(request)
    assert len(queue) == 5 and list(queue) == requests
    assert [serve(queue, 10) for _ in range(5)] == requests
    assert len(queue) == 0 and not queue
    with pytest.raises(IndexError):
        queue.peek()


def test_flooding_tenant_gets_an_equal_share_not_more():
    queue = FairWaitingQueue()
    for _ in range(100):
        queue.push(make("a"))  # a floods
    for _ in range(10):
        queue.push(make("b"))
    served = collections.Counter(serve(queue, 10).tenant for _ in range(20))
    assert served == {"a": 10, "b": 10}
    assert queue.counter("a") == queue.counter("b") == 100


def test_shares_follow_tokens_not_requests():
    queue = FairWaitingQueue()
    for _ in range(30):
        queue.push(make("big"))
        queue.push(make("small"))
    served = collections.Counter()
    for _ in range(30):
        request = queue.pop()
        queue.charge(request.tenant, 30 if request.tenant == "big" else 10)
        served[request.tenant] += 1
    # Equal tokens: three small requests for each big one.
    assert abs(served["small"] - 3 * served["big"]) <= 3


def test_idle_tenant_is_lifted_and_banks_no_credit():
    queue = FairWaitingQueue()
    for _ in range(20):
        queue.push(make("a"))
    for _ in range(10):
        serve(queue, 10)
    assert queue.counter("a") == 100
    late = make("b")
    queue.push(late)  # b was idle all along: it starts at a's counter, not at 0
    assert queue.counter("b") == 100
    served = [serve(queue, 10).tenant for _ in range(6)]
    assert served.count("b") == 1 and served.count("a") == 5  # b's single request, then a again


def test_tenant_with_debt_keeps_it_when_backlogged_again():
    queue = FairWaitingQueue()
    queue.push(make("a"))
    serve(queue, 500)  # a used a lot, then went idle
    for _ in range(3):
        queue.push(make("b"))
    queue.push(make("a"))  # a is back: its counter (500) is above the floor (0), so it stays
    assert queue.counter("a") == 500
    assert [serve(queue, 10).tenant for _ in range(3)] == ["b", "b", "b"]


def test_lift_with_nobody_backlogged_uses_the_tenant_served_last():
    queue = FairWaitingQueue()
    queue.push(make("a"))
    serve(queue, 50)  # a: 50, served at counter 0
    queue.push(make("b"))  # nobody waits: the floor is the counter of the last one served (0)
    assert queue.counter("b") == 0
    serve(queue, 0)
    queue.push(make("a"))
    queue.pop()  # a served at counter 50
    queue.push(make("c"))
    assert queue.counter("c") == 50


def test_front_push_goes_first_within_its_tenant():
    queue = FairWaitingQueue()
    a1, a2 = make("a"), make("a")
    queue.push(a1)
    queue.push(a2)
    preempted = make("a", "preempted")
    queue.push(preempted, front=True)
    assert queue.peek() is preempted
    assert [queue.pop() for _ in range(3)] == [preempted, a1, a2]


def test_remove():
    queue = FairWaitingQueue()
    a, b1, b2 = make("a"), make("b"), make("b")
    for request in (a, b1, b2):
        queue.push(request)
    queue.remove(b1)
    assert len(queue) == 2 and set(map(id, queue)) == {id(a), id(b2)}
    queue.remove(a)  # a's only request: a is no longer backlogged
    assert queue.pop() is b2
    with pytest.raises(ValueError, match="not in the waiting queue"):
        queue.remove(b1)


def test_none_is_a_tenant_and_ties_go_to_the_earliest_head():
    queue = FairWaitingQueue()
    earlier, later = make(None), make("x")
    queue.push(later)
    queue.push(earlier)
    assert queue.counter(None) == queue.counter("x") == 0
    assert queue.pop() is earlier and queue.pop() is later


def test_idle_counters_are_pruned_without_losing_debts():
    queue = FairWaitingQueue()
    queue.push(make("heavy"))
    serve(queue, 10**6)  # a debt far above any floor
    for number in range(3000):  # one-off tenants, each served once at the floor
        queue.push(make(f"t{number}"))
        serve(queue, 0)
    assert len(queue._counters) <= 1024 + 2
    assert queue.counter("heavy") == 10**6


def test_scheduler_uses_the_fair_queue_for_policy_fair():
    from jaxserve.config import SchedulerConfig
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(policy="fair"), KVCacheManager(64, 4), 32)
    assert isinstance(scheduler.waiting, FairWaitingQueue), (
        "scheduler.policy 'fair' must build core.fairness.FairWaitingQueue (the scheduler wiring)")
