"""The host tier: a fixed pool of KV blocks in host memory, keyed by the prefix cache's block hash, LRU.

    one block object per slot: a block's row (every layer's K and V of every cache set, the device layout
    with the block axis taken out, flattened), a disk file's payload as it is; either a numpy array or,
    with `place` (runner/kv_transfer.py on GPUs), a jax Array of its own in pinned host memory, so a block
    moves to and from the device as one plain DMA copy. A slot's object is replaced by each write, never
    written into: a reader holding one (a load in flight, a disk write) keeps valid data after the slot
    is reused.

A key is in one of three states:
    absent -- reserve() --> in transit (a slot is reserved, its data is being written) -- commit() --> present
                            in transit -- abort() --> absent
    present -- evicted (LRU, to make room for a reservation) --> absent, its data handed to `on_evict` first
    present -- discard() --> absent (a swapped request's block, read back)
Only present keys are found by lookup(), so a reader never sees a half-written slot. A pinned key (a load
in progress reads its slot) is never evicted.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np


class HostKVPool:
    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype,
                 on_evict: Callable[[Hashable, np.ndarray], None] | None = None,
                 place: Callable[[np.ndarray], Any] | None = None):
        """`on_evict(key, data)`: called with a present key's block as numpy (never written into by the pool)
        just before its slot is reused. `place(row)`: puts a numpy row into the memory the pool's blocks
        live in (a pinned host jax Array); None: the pool keeps numpy rows."""
        if num_slots < 1:
            raise ValueError(f"a host KV pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.place = place
        self._blocks: list[Any] = [None] * num_slots  # a slot's block object, None while it holds none
        self.on_evict = on_evict
        self._free = list(range(num_slots - 1, -1, -1))
        self._present: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # LRU first
        self._in_transit: dict[Hashable, int] = {}
        self._pins: collections.Counter[Hashable] = collections.Counter()
        self.num_evictions = 0

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    @property
    def num_present(self) -> int:
        return len(self._present)

    @property
    def num_in_transit(self) -> int:
        return len(self._in_transit)

    @property
    def num_reservable(self) -> int:
        """Slots a reservation could take now: free ones and those of unpinned present keys."""
        return len(self._free) + len(self._present) - len(self._pins)

    @property
    def usage(self) -> float:
        """Share of the slots holding or receiving a block."""
        return 1.0 - len(self._free) / self.num_slots

    def state(self, key: Hashable) -> str:
        """'present', 'in_transit' or 'absent'."""
        return "present" if key in self._present else "in_transit" if key in self._in_transit else "absent"

    def lookup(self, key: Hashable) -> int | None:
        """The slot of a present key (now the most recently used), else None."""
        slot = self._present.get(key)
        if slot is not None:
            self._present.move_to_end(key)
        return slot

    def reserve(self, key: Hashable) -> int | None:
        """A slot for `key`'s data, the key now in transit; None when the key is present or in transit
        already, or when every slot is pinned or in transit. Evicts the least recently used present key
        when no slot is free."""
        if key in self._present or key in self._in_transit:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k in self._present if not self._pins[k]), None)
            if victim is None:
                return None
            slot = self._present.pop(victim)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim, self.row(slot))
            self._blocks[slot] = None
        self._in_transit[key] = slot
        return slot

    def commit(self, key: Hashable) -> None:
        """In transit -> present (its slot's data is written)."""
        self._present[key] = self._in_transit.pop(key)

    def abort(self, key: Hashable) -> None:
        """In transit -> absent (the data never came): the slot is free again."""
        slot = self._in_transit.pop(key)
        self._blocks[slot] = None
        self._free.append(slot)

    def write(self, key: Hashable, block) -> None:
        """Fills an in-transit key's slot with `block`: a numpy array (copied, or put into the pool's
        memory by `place`) or a block object of the pool's memory (kept as it is; the caller never writes
        into it)."""
        if isinstance(block, np.ndarray):
            row = np.array(block, self.dtype).reshape(self.block_shape)
            if self.place is None:
                row.flags.writeable = False
                block = row
            else:
                block = self.place(row)
        self._blocks[self._in_transit[key]] = block

    def put(self, key: Hashable, block) -> bool:
        """reserve + write + commit; False (nothing stored) when the key is here already or no slot is free."""
        if self.reserve(key) is None:
            return False
        self.write(key, block)
        self.commit(key)
        return True

    def discard(self, key: Hashable) -> None:
        """Present (unpinned) -> absent: the slot is free again, its data dropped (not handed to on_evict)."""
        if self._pins[key]:
            raise RuntimeError(f"host KV block {key!r} is pinned; unpin it before discarding it")
        slot = self._present.pop(key)
        self._blocks[slot] = None
        self._free.append(slot)

    def pin(self, key: Hashable) -> int:
        """Keeps a present key from eviction until unpin(); returns its slot."""
        slot = self._present[key]
        self._pins[key] += 1
        return slot

    def unpin(self, key: Hashable) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    def row(self, slot: int) -> np.ndarray:
        """A written slot's block as numpy (read-only; a pinned block is copied out)."""
        return np.asarray(self._blocks[slot])

    def read(self, slots: list[int]) -> np.ndarray:
        """[len(slots), *block_shape]: a copy of the written slots' data."""
        return np.stack([self.row(slot) for slot in slots]) if slots else np.zeros((0, *self.block_shape),
                                                                                 self.dtype)

    def blocks(self, slots: list[int]) -> list[Any]:
        """The written slots' block objects (numpy rows, or pinned arrays with `place`): safe to hand to
        another thread or device, as the pool never writes into them."""
        return [self._blocks[slot] for slot in slots]

    def keys(self) -> list[Hashable]:
        """Present keys, least recently used first."""
        return list(self._present)

    def check(self) -> None:
        """Asserts the pool's invariants (tests): every slot is free, present or in transit, exactly once."""
        slots = list(self._free) + list(self._present.values()) + list(self._in_transit.values())
        assert sorted(slots) == list(range(self.num_slots)), "a slot is lost or held twice"
        assert not set(self._present) & set(self._in_transit), "a key is present and in transit"
        assert all(k in self._present for k in self._pins), "a pinned key is not present"
        assert all(self._blocks[slot] is None for slot in self._free), "a free slot holds a block"
        assert all(self._blocks[slot] is not None for slot in self._present.values()), "a present slot is empty"
