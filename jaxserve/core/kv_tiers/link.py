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

A step carries at most `load_budget` prefix loads (None: no bound; a swap-in's loads come on top), so a
long prefix on host never holds up the running requests' step for long: a waiting request whose host
blocks exceed what is left of the step's budget waits (loading() says it is moving) while they are loaded
a budget at a time, each batch into fresh device blocks registered under their keys (free cached blocks,
as a hit's); once the rest fits it is admitted like any other request. A prefix whose host blocks cannot
all fit in the free device blocks is admitted at once instead, with as many loads as the budget and the
free blocks allow (the rest is computed).

Swap preemption uses the same moves under keys of its own (SwapKey, never a prefix-cache key):
    swap_out: every block of the request (its partial last block too) -> saves; each lands pinned on host
    swap_in (once all landed, swap_ready): fresh device blocks -> loads; take() reads them and frees the
        host slots
    drop_swap (the request finished while swapped): its host slots freed, or freed as their copies land

Speculative decoding's guess and lookahead K/V never reaches a tier as a block of its own: evicted blocks
are prefix-cache blocks (full blocks of known tokens), and a swap covers the blocks of the tokens it keeps
(known tokens, excluding the last). Its partial last block may hold guess K/V past them, which the resumed
request writes again before any step reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jaxserve.core.block_pool import BlockPool, KVCacheBlock
    from jaxserve.core.kv_tiers.tiers import KVTiers


@dataclasses.dataclass
class Transfers:
    """One step's block moves, in this order: saves (device -> host), then loads (host -> device)."""

    save_block_ids: list[int]
    save_keys: list[Hashable]
    load_block_ids: list[int]
    # The host slots' block objects, one per load (numpy rows, or pinned arrays: HostKVPool.blocks), which
    # the pool never writes into; None without loads
    load_data: list | None
    # The expert shard of each save and load (ShardedTierLink; empty: every block is shard 0's)
    save_shards: list[int] = dataclasses.field(default_factory=list)
    load_shards: list[int] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.save_block_ids or self.load_block_ids)


class SwapKey(NamedTuple):
    """A swapped request's block on host: pinned from landing until read back, so never evicted to disk."""

    request_id: str
    swap: int  # a number per swap_out: each swap has keys of its own
    index: int  # the block's index in the request's block table


class TierLink:
    def __init__(self, pool: BlockPool, tiers: KVTiers, block_size: int):
        self.pool = pool
        self.tiers = tiers
        self.block_size = block_size
        self._saves: list[tuple[int, Hashable]] = []
        self._loads: dict[int, Hashable] = {}  # device block id -> its key, pinned on host until take()
        self._swapped: dict[str, tuple[list[SwapKey], int]] = {}  # request id -> (its keys, tokens they hold)
        self._dropped: set[SwapKey] = set()  # keys of requests that finished while the keys were in transit
        self._num_swaps = 0
        self.load_budget: int | None = None  # loads one take() may return (module docstring); None: any
        pool.on_evict = self._evicted

    def _evicted(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        load_key = self._loads.pop(block.block_id, None)
        if load_key is not None:
            self.tiers.host.unpin(load_key)
            return
        if self.tiers.host.reserve(key) is not None:
            self._saves.append((block.block_id, key))
        else:
            self.tiers.host.lookup(key)  # on host already (or arriving): now recently used there

    def loading(self, keys: Sequence[Hashable]) -> bool:
        """Whether blocks of this prefix (`keys`: the blocks a hit may cover) are on their way to the
        host tier; starts reading those found on disk. The prefix ends at the first block no tier has, and
        at the host's size (its loaded part is staged there at once)."""
        tiers, host = self.tiers, self.tiers.host
        tiers.poll()
        moving = False
        staged = 0  # blocks of this prefix on host or on their way there
        on_device: list[KVCacheBlock] = []
        on_host: list[Hashable] = []
        for key in keys:
            block = self.pool.get_cached_block(key)
            if block is not None:
                on_device.append(block)
                continue
            where = tiers.locate(key)
            if where == "host":
                host.lookup(key)  # now recently used: reads for the rest of the prefix evict other blocks first
                on_host.append(key)
            elif where == "moving":
                moving = True
            elif where == "disk":
                if staged >= host.num_slots:
                    break
                if not tiers.start_read(key):
                    # No slot free now: wait while slots are in transit or pinned by this step's loads (they
                    # can be evicted once landed, or once take() read them); otherwise the prefix stops here.
                    moving = moving or host.num_in_transit > 0 or bool(self._loads)
                    break
                moving = True
            else:
                if tiers.disk is not None:
                    tiers.counters.disk_misses += self.block_size
                break
            staged += 1
        on_host = [key for key in on_host if host.state(key) == "present"]  # (a disk read may have evicted one)
        if len(on_host) > self.loads_left:
            room = self.pool.num_free_blocks - sum(1 for block in on_device if block.ref_cnt == 0)
            if len(on_host) <= room:  # (else it could never be all on the device: admitted, see above)
                self._preload(on_device, on_host[:self.loads_left])
                return True
        return moving

    @property
    def loads_left(self) -> int | float:
        """Loads the next take() may still carry."""
        return float("inf") if self.load_budget is None else max(0, self.load_budget - len(self._loads))

    def _preload(self, on_device: list[KVCacheBlock], keys: list[Hashable]) -> None:
        """Loads host blocks `keys` into fresh device blocks registered under them (free cached blocks), the
        prefix's device blocks `on_device` held meanwhile so that none of them is the one evicted."""
        if not keys:
            return
        pool, host = self.pool, self.tiers.host
        pool.touch(on_device)
        for key in keys:
            host.pin(key)
        fresh = pool.get_new_blocks(len(keys))
        for block, key in zip(fresh, keys):
            pool.cache_full_block(block, key)
            self._loads[block.block_id] = key
        pool.free_blocks(reversed(on_device + fresh))
        self.tiers.counters.host_hits += len(keys) * self.block_size

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
            elif num_loads + 1 > min(room, self.loads_left):
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
        """The saves and loads asked since the last take(); the loads' host blocks are taken out now (a
        slot freed here may be reused at once: its block object is not)."""
        saves, self._saves = self._saves, []
        loads, self._loads = sorted(self._loads.items()), {}
        host, counters = self.tiers.host, self.tiers.counters
        data = None
        if loads:
            data = host.blocks([host.lookup(key) for _, key in loads])
            for _, key in loads:
                host.unpin(key)
                if type(key) is SwapKey:
                    host.discard(key)
            counters.host_bytes_out += len(data) * host.block_bytes
        return Transfers([block_id for block_id, _ in saves], [key for _, key in saves],
                         [block_id for block_id, _ in loads], data)

    def finish_saves(self, keys: Sequence[Hashable], data: Sequence, shards: Sequence[int] = ()) -> None:
        """The device -> host copies of `keys` landed: `data[i]` is keys[i]'s block, a numpy row or a pinned
        array the pool keeps (`shards`: unused, one shard)."""
        host = self.tiers.host
        for key, block in zip(keys, data):
            if self._dropped and key in self._dropped:
                self._dropped.remove(key)
                host.abort(key)
                continue
            host.write(key, block)
            host.commit(key)
            if type(key) is SwapKey:
                host.pin(key)
        self.tiers.counters.host_bytes_in += len(keys) * host.block_bytes

    def device_only(self, shard: int = 0) -> list[tuple[int, Hashable, int]]:
        """(block id, key, `shard`) of every block cached on the device that no tier below holds (nor is
        loading)."""
        return [(block.block_id, key, shard) for key, block in self.pool.cached_blocks.items()
                if block.block_id not in self._loads and self.tiers.locate(key) is None]

    # ---- swap preemption ----
    def swap_out(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Saves `block_ids` (a preempted request's blocks holding `num_tokens` tokens) to host slots that stay
        pinned until swap_in; False, nothing done, when the host pool lacks the room."""
        host = self.tiers.host
        if host.num_reservable < len(block_ids):
            return False
        self._num_swaps += 1
        keys = [SwapKey(request_id, self._num_swaps, i) for i in range(len(block_ids))]
        for key in keys:
            host.reserve(key)  # (each succeeds: reservations evict only unpinned present keys)
        self._saves += zip(block_ids, keys)
        self._swapped[request_id] = (keys, num_tokens)
        self.tiers.counters.swaps_out += 1
        return True

    def swapped_tokens(self, request_id: str) -> int:
        """Tokens a swapped request's host blocks hold (0: it is not swapped)."""
        entry = self._swapped.get(request_id)
        return entry[1] if entry is not None else 0

    def swap_ready(self, request_id: str) -> bool:
        """Whether every block of the swapped request landed on host."""
        host = self.tiers.host
        return all(host.state(key) == "present" for key in self._swapped[request_id][0])

    def swap_in(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Loads the swapped request's blocks into `block_ids` (fresh device blocks, its first ones)."""
        keys, _ = self._swapped.pop(request_id)
        self._loads.update(zip(block_ids, keys))  # (pinned since they landed)
        self.tiers.counters.swaps_in += 1

    def drop_swap(self, request_id: str) -> None:
        """The swapped request finished (aborted): its host blocks are freed now or as they land."""
        keys, _ = self._swapped.pop(request_id, ((), 0))
        host = self.tiers.host
        for key in keys:
            if host.state(key) == "present":
                host.unpin(key)
                host.discard(key)
            else:
                self._dropped.add(key)

    def reset(self) -> None:
        """The device's prefix cache was cleared: pending loads have no target any more."""
        for key in self._loads.values():
            self.tiers.host.unpin(key)
        self._loads.clear()



class ShardedTierLink:
    """The expert shards' links (one per shard's KV manager, each over its own tiers) as one for the mover:
    take() joins their moves shard after shard, each block tagged with its shard (its block ids are the
    shard's), and landed saves go back to the link that asked them."""

    def __init__(self, links: Sequence[TierLink]):
        self.links = list(links)

    def take(self) -> Transfers:
        moves = [link.take() for link in self.links]
        data = [block for m in moves if m.load_data is not None for block in m.load_data]
        return Transfers([i for m in moves for i in m.save_block_ids], [k for m in moves for k in m.save_keys],
                         [i for m in moves for i in m.load_block_ids], data or None,
                         [shard for shard, m in enumerate(moves) for _ in m.save_block_ids],
                         [shard for shard, m in enumerate(moves) for _ in m.load_block_ids])

    def finish_saves(self, keys: Sequence[Hashable], data: Sequence, shards: Sequence[int] = ()) -> None:
        for shard, link in enumerate(self.links):
            rows = [i for i, s in enumerate(shards) if s == shard]
            if rows:
                link.finish_saves([keys[i] for i in rows], [data[i] for i in rows])

    def device_only(self) -> list[tuple[int, Hashable, int]]:
        return [entry for shard, link in enumerate(self.links) for entry in link.device_only(shard)]
