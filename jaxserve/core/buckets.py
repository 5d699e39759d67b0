"""Shape ladders: every jitted shape of the engine comes from here.

    tokens in a step T --pad_tokens--> a rung of the token ladder
    requests in a step R --pad_requests--> a rung of the request ladder
    precompile_plan() --> every (T, R) pair a step can produce, compiled at start-up

Per-request values are traced arrays, never shapes, so steady state compiles nothing.
"""

from __future__ import annotations

import bisect
import dataclasses


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2*low, ... up to and including `high` (added if it is not itself a power of two)."""
    rungs, value = [], max(1, low)
    while value < high:
        rungs.append(value)
        value *= 2
    rungs.append(high)
    return rungs


@dataclasses.dataclass(frozen=True)
class BucketLadders:
    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, token_buckets=None,
              request_buckets=None, min_tokens: int = 16) -> BucketLadders:
        tokens = sorted(set(token_buckets or powers_of_two(min(min_tokens, max_num_batched_tokens),
                                                           max_num_batched_tokens)))
        requests = sorted(set(request_buckets or powers_of_two(1, max_num_seqs)))
        if tokens[-1] < max_num_batched_tokens:
            raise ValueError(f"largest token bucket {tokens[-1]} is below max_num_batched_tokens "
                             f"{max_num_batched_tokens}; add a bucket or lower the budget")
        if requests[-1] < max_num_seqs:
            raise ValueError(f"largest request bucket {requests[-1]} is below max_num_seqs {max_num_seqs}")
        return cls(tuple(tokens), tuple(requests))

    @staticmethod
    def _pad(ladder: tuple[int, ...], n: int) -> int:
        i = bisect.bisect_left(ladder, n)
        if i == len(ladder):
            raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")
        return ladder[i]

    def pad_tokens(self, num_tokens: int) -> int:
        return self._pad(self.token_buckets, num_tokens)

    def pad_requests(self, num_requests: int) -> int:
        return self._pad(self.request_buckets, num_requests)

    def decode_plan(self) -> list[tuple[int, int]]:
        """The (T, R) pairs of pure decode steps (one token per request), in order of R."""
        pairs = {(self.pad_tokens(r), self.pad_requests(r)) for r in range(1, self.request_buckets[-1] + 1)
                 if r <= self.token_buckets[-1]}
        return sorted(pairs, key=lambda pair: (pair[1], pair[0]))

    def precompile_plan(self) -> list[tuple[int, int]]:
        """All (T, R) bucket pairs a real step can hit: R real requests need at least R tokens."""
        plan = []
        for i, r_bucket in enumerate(self.request_buckets):
            min_real_requests = self.request_buckets[i - 1] + 1 if i else 1
            for t_bucket in self.token_buckets:
                if min_real_requests <= t_bucket:
                    plan.append((t_bucket, r_bucket))
        return plan
