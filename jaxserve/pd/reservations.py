"""Block bookkeeping of a KV transfer on both sides (host-only; no JAX): decode reservations, prefill leases.

Decode side, one transfer:

    reserve(id, prompt) --> RESERVED: the prompt's usable full blocks held (ref +1): the leading ones already
                            in the prefix cache are pinned (not sent again), the rest are fresh blocks, not in
                            the prefix cache, so nothing can read them before the bytes land
    targets(id) / mark_ready(id) --> READY: the transferred blocks written, then registered in the prefix
                            cache under the prompt's keys; still held, for the request to come and take them
    claim(id, request) --> CLAIMED: the request's prompt matches; held until the scheduler admitted the
                            request (its own prefix-cache hit references them) or it ended: release_claims
    abort(id) / expire(now) --> freed (RESERVED or READY past its deadline, or aborted)

Prefill side: pin(id, prompt) holds the finished request's usable full blocks (found in its prefix cache)
until release(id) on the decode side's ack, an abort or the lease deadline (expire(now)).

"Usable" blocks: a request's prefix-cache hit covers at most num_tokens - 1 tokens (its last token is always
computed for its logits), so only the first (len(prompt) - 1) // block_size full blocks are transferred; the
decode instance computes the tail itself. Every path out of every state frees exactly what it held, and a
late or duplicate event for a transfer not in the state it expects is ignored (returns None / False).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Hashable, Sequence

from jaxserve.core.kv_cache_manager import KVCacheBlock, KVCacheManager


def usable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    return max(0, (num_prompt_tokens - 1) // block_size)


class State(enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    CLAIMED = "claimed"


@dataclasses.dataclass
class Reservation:
    transfer_id: str
    keys: list[Hashable]  # the prompt's usable blocks' keys
    blocks: list[KVCacheBlock]  # every block held: the pinned hits, then the fresh ones
    skip: int  # leading blocks already cached here (pinned, not transferred)
    deadline: float
    state: State = State.RESERVED
    request_id: str | None = None

    @property
    def target_ids(self) -> list[int]:
        """The fresh blocks the transfer writes, in prompt order."""
        return [block.block_id for block in self.blocks[self.skip:]]


class Refused(Exception):
    """A reservation that cannot be made now (no free blocks); the message says what to do."""


class _Holder:
    def __init__(self, kv_cache: KVCacheManager, clock: Callable[[], float]):
        self.kv_cache = kv_cache
        self.pool = kv_cache.pool
        self.clock = clock
        self._open: dict = {}  # transfer id -> its Reservation or Lease

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._open

    @property
    def num_blocks_held(self) -> int:
        return sum(len(held.blocks) for held in self._open.values())

    def _pin_cached(self, keys: Sequence[Hashable]) -> list[KVCacheBlock]:
        """The leading run of `keys` found in the prefix cache, each referenced once more."""
        blocks = []
        for key in keys:
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            blocks.append(block)
        self.pool.touch(blocks)
        return blocks

    def _free(self, blocks: list[KVCacheBlock]) -> None:
        self.pool.free_blocks(reversed(blocks))


class DecodeReservations(_Holder):
    def __init__(self, kv_cache: KVCacheManager, hold_s: float, headroom_blocks: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        """`hold_s`: how long READY blocks wait for their request; `headroom_blocks`: free blocks a
        reservation must leave for the running requests."""
        super().__init__(kv_cache, clock)
        self.hold_s = hold_s
        self.headroom_blocks = headroom_blocks
        self._open: dict[str, Reservation] = {}

    def reserve(self, transfer_id: str, token_ids: Sequence[int], cache_salt: str | None,
                timeout_s: float) -> Reservation:
        """Holds the prompt's usable blocks until `timeout_s` from now; the same id again returns the open
        reservation. Raises Refused when the fresh blocks are not free."""
        existing = self._open.get(transfer_id)
        if existing is not None:
            return existing
        keys = self.kv_cache.block_keys(token_ids, cache_salt)[:usable_blocks(len(token_ids),
                                                                                 self.kv_cache.block_size)]
        hits = self._pin_cached(keys)
        need = len(keys) - len(hits)
        if need > self.pool.num_free_blocks - self.headroom_blocks:
            self._free(hits)
            raise Refused(f"the decode instance has {self.pool.num_free_blocks} free KV blocks, the transfer "
                          f"needs {need} (plus {self.headroom_blocks} kept free); retry later or on another "
                          f"decode instance")
        fresh = self.pool.get_new_blocks(need) if need else []
        reservation = Reservation(transfer_id, keys, hits + fresh, len(hits), self.clock() + timeout_s)
        self._open[transfer_id] = reservation
        return reservation

    def targets(self, transfer_id: str) -> list[int] | None:
        """The block ids a ready transfer writes, or None when the id is not RESERVED (unknown, expired,
        aborted, or ready already: a late or duplicate ready is ignored)."""
        reservation = self._open.get(transfer_id)
        if reservation is None or reservation.state is not State.RESERVED:
            return None
        return reservation.target_ids

    def mark_ready(self, transfer_id: str) -> bool:
        """After the targets were written: registers them in the prefix cache; READY until hold_s from now."""
        reservation = self._open.get(transfer_id)
        if reservation is None or reservation.state is not State.RESERVED:
            return False
        for block, key in zip(reservation.blocks[reservation.skip:], reservation.keys[reservation.skip:]):
            self.pool.cache_full_block(block, key)
        reservation.state = State.READY
        reservation.deadline = self.clock() + self.hold_s
        return True

    def claim(self, transfer_id: str, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> bool:
        """A request takes a READY transfer when its prompt has the same keys; the blocks stay held until
        release_claims sees it admitted or gone."""
        reservation = self._open.get(transfer_id)
        if reservation is None or reservation.state is not State.READY:
            return False
        keys = self.kv_cache.block_keys(token_ids, cache_salt)[:len(reservation.keys)]
        if keys != reservation.keys:
            return False
        reservation.state = State.CLAIMED
        reservation.request_id = request_id
        return True

    def release_claims(self, waiting: Callable[[str], bool]) -> int:
        """Frees the claimed transfers whose request is no longer waiting (`waiting(request_id)` false):
        admitted requests hold the blocks themselves now. Returns how many were freed."""
        done = [r for r in self._open.values() if r.state is State.CLAIMED and not waiting(r.request_id)]
        for reservation in done:
            self._close(reservation)
        return len(done)

    def abort(self, transfer_id: str) -> bool:
        """Frees an unclaimed transfer (False when unknown or claimed: a late abort is ignored)."""
        reservation = self._open.get(transfer_id)
        if reservation is None or reservation.state is State.CLAIMED:
            return False
        self._close(reservation)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Frees every unclaimed transfer past its deadline; returns their ids."""
        now = self.clock() if now is None else now
        late = [r for r in self._open.values() if r.state is not State.CLAIMED and r.deadline <= now]
        for reservation in late:
            self._close(reservation)
        return [r.transfer_id for r in late]

    def _close(self, reservation: Reservation) -> None:
        # A RESERVED transfer's fresh blocks were never registered; a READY one's hold valid K/V and stay
        # cached (free, evictable) like any finished request's.
        del self._open[reservation.transfer_id]
        self._free(reservation.blocks)


@dataclasses.dataclass
class Lease:
    transfer_id: str
    blocks: list[KVCacheBlock]
    deadline: float


class PrefillLeases(_Holder):
    def __init__(self, kv_cache: KVCacheManager, clock: Callable[[], float] = time.monotonic):
        super().__init__(kv_cache, clock)
        self._open: dict[str, Lease] = {}

    def pin(self, transfer_id: str, token_ids: Sequence[int], cache_salt: str | None, skip: int,
            timeout_s: float) -> list[int] | None:
        """Holds the prompt's usable blocks past the first `skip` (the decode side has those) until release
        or `timeout_s` from now; returns their ids, or None when they are not all in the prefix cache (the
        transfer cannot be served) or the id is held already."""
        if transfer_id in self._open:
            return None
        keys = self.kv_cache.block_keys(token_ids, cache_salt)[:usable_blocks(len(token_ids),
                                                                                 self.kv_cache.block_size)]
        blocks = self._pin_cached(keys)
        if len(blocks) < len(keys):
            self._free(blocks)
            return None
        held = blocks[skip:]
        self._free(blocks[:skip])
        self._open[transfer_id] = Lease(transfer_id, held, self.clock() + timeout_s)
        return [block.block_id for block in held]

    def release(self, transfer_id: str) -> bool:
        """Frees a lease (ack, abort or failure); False when unknown (a late or duplicate ack)."""
        lease = self._open.pop(transfer_id, None)
        if lease is None:
            return False
        self._free(lease.blocks)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        late = [lease.transfer_id for lease in self._open.values() if lease.deadline <= now]
        for transfer_id in late:
            self.release(transfer_id)
        return late
