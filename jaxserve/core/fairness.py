"""Per-tenant fair sharing of the waiting queue: a virtual token counter (VTC) per tenant.

    push(request[, front]) --> its tenant's FIFO (front=True: a preempted request goes back to the head)
    peek() / pop()         --> the head of the backlogged tenant with the smallest counter (ties: the
                               shorter backlog, so a newcomer lifted to a flooder's counter goes first;
                               then the earlier head)
    charge(tenant, n)      <-- the scheduler, every step: the tokens computed for the tenant

A tenant is "backlogged" while it has requests here. The policy is VTC from Sheng et al., "Fairness in
Serving Large Language Models" (OSDI '24): serve the backlogged tenant that has received the least
service, so a tenant that floods the server cannot starve the others; tokens are the unit of service.
It is a drop-in for scheduler.WaitingQueue (same methods, plus `charge`); `scheduler.policy: fair`.

Invariants:
- A tenant that becomes backlogged is lifted to the floor: the smallest counter among backlogged
  tenants, or with none, the counter of the tenant served last. Idle time banks no credit.
- An idle tenant whose counter is at or below the floor would be lifted anyway, so dropping its
  counter loses nothing; such counters are pruned, so one-off tenant names cannot grow memory.
- Within a tenant, order is FCFS (priority values are not consulted).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from jaxserve.request import Request

_PRUNE_AT = 1024  # idle-tenant counters kept before a prune pass


class FairWaitingQueue:
    def __init__(self):
        self._queues: dict[str | None, collections.deque[Request]] = {}  # backlogged tenants only
        self._counters: dict[str | None, int] = {}
        self._last_served = 0  # the floor when no tenant is backlogged
        self._len = 0

    def _floor(self) -> int:
        if self._queues:
            return min(self._counters[tenant] for tenant in self._queues)
        return self._last_served

    def counter(self, tenant: str | None) -> int:
        """Service charged to `tenant` so far (lifted to the floor when it last became backlogged)."""
        return self._counters.get(tenant, self._floor())

    def push(self, request: Request, front: bool = False) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None:
            floor = self._floor()
            self._counters[tenant] = max(self._counters.get(tenant, floor), floor)
            queue = self._queues[tenant] = collections.deque()
            if len(self._counters) > max(_PRUNE_AT, 2 * len(self._queues)):
                self._prune(floor)
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._len += 1

    def _prune(self, floor: int) -> None:
        self._counters = {tenant: counter for tenant, counter in self._counters.items()
                          if tenant in self._queues or counter > floor}

    def _next_tenant(self) -> str | None:
        if not self._queues:
            raise IndexError("peek/pop from an empty waiting queue")
        queues, counters = self._queues, self._counters
        return min(queues, key=lambda tenant: (counters[tenant], len(queues[tenant]), queues[tenant][0].arrival_time))

    def peek(self) -> Request:
        return self._queues[self._next_tenant()][0]

    def pop(self) -> Request:
        tenant = self._next_tenant()
        queue = self._queues[tenant]
        request = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._last_served = self._counters[tenant]
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None or request not in queue:
            raise ValueError(f"request {request.request_id!r} is not in the waiting queue")
        queue.remove(request)
        if not queue:
            del self._queues[request.tenant]
        self._len -= 1

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        """Add `num_tokens` of service to `tenant`'s counter."""
        self._counters[tenant] = self.counter(tenant) + num_tokens

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue
