"""The device's block pool: KV cache blocks, their ref counts, the LRU free queue and the prefix-cache map
(host-only; no JAX). KVCacheManager (kv_cache_manager.py) owns one and gives requests its blocks.

    get_new_blocks: free queue head (least recently freed; a cached block there is evicted: on_evict, then
                    its hash dropped) -> ref_cnt 1
    touch: a hit on a cached block takes a reference (a free one leaves the queue)
    free_blocks: references dropped; a block reaching 0 joins the queue's tail (its hash kept: a later hit
                 may take it back)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator

BlockHash = Hashable  # bytes for sha256, int for builtin
NULL_BLOCK_ID = 0


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0  # number of live requests whose block list holds this block
        self.block_hash: BlockHash | None = None  # set iff the block is in BlockPool.cached_blocks
        self.prev_free: KVCacheBlock | None = None  # links are set iff the block is in the free queue
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; head = next to evict (LRU order).

    O(1) append at the tail, pop at the head, and removal from the middle (a free cached block hit).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self.head = KVCacheBlock(-1)  # sentinels: never real blocks
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free, block.next_free = last, self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All physical blocks, their ref counts, the free queue and the prefix-cache map.

    Invariants: a non-null block is in the free queue iff its ref_cnt is 0; a block has a hash iff it
    is the value of cached_blocks under that hash; the null block is in neither and its ref_cnt is 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks is {num_blocks} but must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # Called with each cached block evicted, before its hash is dropped (the tiers' write-back).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of the non-null blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops `num_blocks` from the LRU head, evicting their cached contents; each gets ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching 0 join the tail in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        # NOTE: when another request registered the same content first, this block stays uncached;
        # the map keeps one block per key and the duplicate is reused as a plain block once freed.
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True
