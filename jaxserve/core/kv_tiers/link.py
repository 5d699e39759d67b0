"""The KV cache manager's link to the tiers: which device blocks to write back, which to load, and when a
request's prefix is still on its way up from disk.

    BlockPool evicts a cached block --> save: (block id, key); the key is in transit on host until the
        runner's device -> host copy lands (finish_saves), so the host never serves a half-copied block
    prefix lookup misses on device, the key is present on host --> a fresh device block registered under
        the key (a free cached block, like any prefix hit) + load: (block id, key), the key pinned on host
    take(): the step's saves and loads; the runner dispatches the saves' gathers, then the loads' scatters,
        before the step's forward, so the device runs them in that order: a block evicted and reused as a
        load target in one schedule() is read before it is overwritten, and every step that reads a loaded
        block runs after its load.

A load target evicted before take() (a refused request's hit, its block reused in the same schedule())
is dropped without a save: its data never reached the device and the host still has it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_manager import BlockPool, KVCacheBlock
    from jaxserve.core.kv_tiers.tiers import KVTiers


@dataclasses.dataclass
class Transfers:
    """One step's block moves, in this order: saves (device -> host), then loads (host -> device)."""

    save_block_ids: list[int]
    save_keys: list[Hashable]
    load_block_ids: list[int]
    load_data: np.ndarray | None  # [len(load_block_ids), *block_shape], a copy of the host slots

    def __bool__(self) -> bool:
        return bool(self.save_block_ids or self.load_block_ids)


class TierLink:
    def __init__(self, pool: BlockPool, tiers: KVTiers, block_size: int):
        self.pool = pool
        self.tiers = tiers
        self.block_size = block_size
        self._saves: list[tuple[int, Hashable]] = []
        self._loads: dict[int, Hashable] = {}  # device block id -> its key, pinned on host until take()
        pool.on_evict = self._evicted

    def _evicted(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if self._loads.pop(block.block_id, None) is not None:
            self.tiers.host.unpin(key)
            return
        if self.tiers.host.reserve(key) is not None:
            self._saves.append((block.block_id, key))
        else:
            self.tiers.host.lookup(key)  # on host already (or arriving): now recently used there

    def loading(self, keys: Sequence[Hashable]) -> bool:
        """Whether blocks of this prefix (`keys`: the blocks a hit may cover) are on their way to the
        host tier; starts reading those found on disk. The prefix ends at the first block no tier has."""
        tiers = self.tiers
        tiers.poll()
        moving = False
        for key in keys:
            if self.pool.get_cached_block(key) is not None:
                continue
            where = tiers.locate(key)
            if where == "disk":
                if not tiers.start_read(key):
                    break  # no host slot free now: the prefix stops here
                moving = True
            elif where == "moving":
                moving = True
            elif where is None:
                if tiers.disk is not None:
                    tiers.counters.disk_misses += self.block_size
                break
        return moving

    def extend_hits(self, keys: Sequence[Hashable], hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """`hits` (the device's run of `keys` from the start) extended through the blocks present on host,
        each given a fresh device block to load into, and the device blocks between them; as many as
        free device blocks allow. Takes no references: the blocks are free cached blocks."""
        pool, host, size = self.pool, self.tiers.host, self.block_size
        chain: list[tuple[KVCacheBlock | None, Hashable]] = []  # (device block, or None: load it; key)
        num_loads = 0
        room = pool.num_free_blocks - sum(1 for block in hits if block.ref_cnt == 0)  # free once hits are held
        for key in keys[len(hits):]:
            block = pool.get_cached_block(key)
            if block is not None:
                if block.ref_cnt == 0:
                    if num_loads > room - 1:
                        break
                    room -= 1
            elif host.state(key) != "present":
                self.tiers.counters.host_misses += size
                break
            elif num_loads + 1 > room:
                break
            else:
                num_loads += 1
            chain.append((block, key))
        if num_loads == 0:
            return hits + [block for block, _ in chain]
        # Hold every device hit while fresh blocks are popped (evicting others, whose write-back may
        # evict host blocks), so that neither a hit nor a host block to load is the one evicted.
        held = hits + [block for block, _ in chain if block is not None]
        pool.touch(held)
        for block, key in chain:
            if block is None:
                host.pin(key)
        fresh = iter(pool.get_new_blocks(num_loads))
        blocks = list(hits)
        for block, key in chain:
            if block is None:
                block = next(fresh)
                pool.cache_full_block(block, key)
                self._loads[block.block_id] = key
            blocks.append(block)
        self.tiers.counters.host_hits += num_loads * size
        # Freed deepest first, as a request's blocks are: the deepest is evicted first.
        pool.free_blocks(reversed(blocks))
        return blocks

    def take(self) -> Transfers:
        """The saves and loads asked since the last take(); the loads' host data is copied out now."""
        saves, self._saves = self._saves, []
        loads, self._loads = sorted(self._loads.items()), {}
        host = self.tiers.host
        data = None
        if loads:
            data = host.read([host.lookup(key) for _, key in loads])
            for _, key in loads:
                host.unpin(key)
            self.tiers.counters.host_bytes_out += data.nbytes
        return Transfers([block_id for block_id, _ in saves], [key for _, key in saves],
                         [block_id for block_id, _ in loads], data)

    def finish_saves(self, keys: Sequence[Hashable], data: np.ndarray) -> None:
        """The device -> host copies of `keys` landed: `data[i]` is keys[i]'s block."""
        host = self.tiers.host
        for key, block in zip(keys, data):
            host.write(key, block)
            host.commit(key)
        self.tiers.counters.host_bytes_in += len(keys) * host.block_bytes

    def abort_saves(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self.tiers.host.abort(key)

    def reset(self) -> None:
        """The device's prefix cache was cleared: pending loads have no target any more."""
        for key in self._loads.values():
            self.tiers.host.unpin(key)
        self._loads.clear()

