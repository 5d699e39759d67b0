"""Paged KV-cache bookkeeping: block pool, prefix-cache hash chain, LRU eviction (host-only; no JAX).

Data flow, one request:

    scheduler                         KVCacheManager                          BlockPool
    get_computed_blocks(req) ------> hash req's full blocks (incremental) --> cached_blocks lookup
        <- (hit block ids, hit tokens)   longest cached run from the start, < num_tokens tokens
    req.num_computed_tokens = hits
    allocate_slots(req, n, hit ids) -> touch hit blocks, get_new_blocks(...) -> free queue head (evicts)
        <- new block ids | None         register newly full blocks ----------> cached_blocks[hash] = block
    free(req) ----------------------> blocks in reverse order ---------------> free queue tail (LRU)
                                      (unwritten registered blocks uncached first)

The runner knows only block ids; the physical layout of the cache arrays belongs to the attention
backend. Block 0 is the null block: padding tokens write there and it is never handed out.

A full block's key is a hash chain: key_i = H(key_{i-1}, tokens of block i, extra keys), rooted in a
random per-engine root, or in one derived from cache.prefix_hash_seed (root_hash) so that engines and
restarts sharing the seed agree on keys; equal keys mean equal token prefixes (with equal LoRA and
salt). The salt enters only block 0's key; the chain carries it into every later key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from jaxserve.core.kv_tiers.link import TierLink

if TYPE_CHECKING:
    from jaxserve.core.kv_tiers.tiers import KVTiers
    from jaxserve.request import Request

BlockHash = Hashable  # bytes for sha256, int for builtin
NULL_BLOCK_ID = 0
_KEY_VERSION = b"jaxserve.kv.v1"  # bump when the key encoding changes (host-memory tiers persist keys)


def encode_block_key(parent: bytes, token_ids: Sequence[int], lora_id: int | None,
                     mm_hashes: Sequence[str], cache_salt: str | None) -> bytes:
    """Canonical binary encoding of one block's key: fixed field order, every field self-delimiting.

    Each variable-length field is length-prefixed and each optional one tagged, so no two distinct
    field tuples share an encoding (e.g. tokens [1, 23] vs [12, 3], or salt "a" vs "a" + tokens).
    """
    parts = [_KEY_VERSION, struct.pack("<I", len(parent)), parent,
             struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids),
             b"\x00" if lora_id is None else struct.pack("<Bq", 1, lora_id),
             struct.pack("<I", len(mm_hashes))]
    for mm_hash in mm_hashes:
        encoded = mm_hash.encode()
        parts += (struct.pack("<I", len(encoded)), encoded)
    if cache_salt is None:
        parts.append(b"\x00")
    else:
        encoded = cache_salt.encode()
        parts += (struct.pack("<BI", 1, len(encoded)), encoded)
    return b"".join(parts)


def hash_block_sha256(parent: bytes, token_ids: Sequence[int], lora_id: int | None,
                      mm_hashes: Sequence[str], cache_salt: str | None) -> bytes:
    return hashlib.sha256(encode_block_key(parent, token_ids, lora_id, mm_hashes, cache_salt)).digest()


def hash_block_builtin(parent: BlockHash, token_ids: Sequence[int], lora_id: int | None,
                       mm_hashes: Sequence[str], cache_salt: str | None) -> int:
    # NOTE: 64-bit and not collision resistant; keyed per process only through Python's hash
    # randomisation (of the root seed bytes and the salt). For single-tenant use.
    return hash((parent, tuple(token_ids), lora_id, tuple(mm_hashes), cache_salt))


_HASH_FUNCTIONS = {"sha256": hash_block_sha256, "builtin": hash_block_builtin}


def root_hash(seed: bytes | int | None) -> bytes:
    """The chain's root: 32 random bytes without a seed (keys unpredictable to other processes), the
    given bytes, or, for an integer seed (cache.prefix_hash_seed), a digest of it, equal in every process."""
    if seed is None:
        return os.urandom(32)
    if isinstance(seed, int):
        return hashlib.sha256(_KEY_VERSION + b".root." + str(seed).encode()).digest()
    return bytes(seed)


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


@dataclasses.dataclass(frozen=True)
class KVCacheStats:
    queries: int  # tokens looked up in the prefix cache
    hits: int  # of those, tokens found (on device, or loaded back from a tier below)
    evictions: int  # cached blocks whose contents were dropped to reuse the block
    # The tiers (kv_tiers.tiers.TierCounters; 0 without them): tokens found in a tier after the device
    # missed, tokens asked of it and not found, bytes written into it and read from it, blocks evicted.
    host_hits: int = 0
    host_misses: int = 0
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    host_evictions: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_bytes_in: int = 0
    disk_bytes_out: int = 0
    disk_evictions: int = 0
    disk_errors: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _RequestState:
    __slots__ = ("blocks", "block_hashes", "num_cached_blocks")

    def __init__(self):
        self.blocks: list[KVCacheBlock] = []  # the block table; append-only until free()
        self.block_hashes: list[BlockHash] = []  # keys of the request's first len() full blocks
        self.num_cached_blocks = 0  # blocks[:n] were offered to the prefix cache already


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256", hash_seed: bytes | int | None = None, tiers: KVTiers | None = None):
        """`tiers`: host (and disk) tiers under the prefix cache: evicted cached blocks are written back
        there and prefix lookups continue there (kv_tiers/link.py); the engine moves the blocks
        (`tier_link.take()` each step)."""
        if block_size < 1:
            raise ValueError(f"block_size is {block_size} but must be positive")
        if hash_algo not in _HASH_FUNCTIONS:
            raise ValueError(f"hash_algo is {hash_algo!r}; choose one of {sorted(_HASH_FUNCTIONS)}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._hash_block = _HASH_FUNCTIONS[hash_algo]
        # The chain's root: random per engine unless seeded (cache.prefix_hash_seed: engines sharing a
        # disk tier, restarts), so keys are not predictable across processes by default.
        self._root_hash: bytes = root_hash(hash_seed)
        self._requests: dict[str, _RequestState] = {}
        # The shortcut of allocate_slots (read by the scheduler's decode fast path too): request id -> the
        # tokens its blocks hold. While num_computed_tokens + new tokens <= this, no block is needed and
        # none fills, so allocate_slots has nothing to do.
        self.fast_until: dict[str, int] = {}
        self._queries = 0
        self._hits = 0
        self.tiers = tiers if enable_caching else None
        self.tier_link = TierLink(self.pool, tiers, block_size) if self.tiers is not None else None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def stats(self) -> KVCacheStats:
        counters = dataclasses.asdict(self.tiers.counters) if self.tiers is not None else {}
        return KVCacheStats(self._queries, self._hits, self.pool.num_evictions, **counters)

    def get_block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return [block.block_id for block in state.blocks] if state else []

    def _hash_full_blocks(self, request: Request, state: _RequestState, num_full_blocks: int) -> None:
        """Extends state.block_hashes to `num_full_blocks` keys, hashing only the new blocks."""
        hashes, size, tokens = state.block_hashes, self.block_size, request.all_token_ids
        parent = hashes[-1] if hashes else self._root_hash
        for i in range(len(hashes), num_full_blocks):
            salt = request.cache_salt if i == 0 else None  # chained into every later key
            parent = self._hash_block(parent, tokens[i * size:(i + 1) * size], request.lora_id, (), salt)
            hashes.append(parent)

    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None = None,
                   lora_id: int | None = None) -> list[BlockHash]:
        """The keys of the full blocks of a prompt `token_ids`, as a request with that prompt gets them
        (the chain is rooted in this manager's root: keys are meaningful to this manager only)."""
        keys, parent, size = [], self._root_hash, self.block_size
        for i in range(len(token_ids) // size):
            parent = self._hash_block(parent, token_ids[i * size:(i + 1) * size], lora_id, (),
                                      cache_salt if i == 0 else None)
            keys.append(parent)
        return keys

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached run of the request's full blocks from its start; takes no references.

        Covers at most num_tokens - 1 tokens: the last token is always computed, for its logits.
        """
        if not self.enable_caching:
            return [], 0
        # NOTE: the hashes are kept for a waiting request too (it may be refused and retried);
        # free() forgets them, so every request must end in free(), aborted ones included.
        state = self._requests.setdefault(request.request_id, _RequestState())
        num_tokens = request.num_tokens
        self._hash_full_blocks(request, state, num_tokens // self.block_size)
        keys = state.block_hashes[:(num_tokens - 1) // self.block_size]
        blocks = []
        for block_hash in keys:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.tier_link is not None and len(blocks) < len(keys):
            blocks = self.tier_link.extend_hits(keys, blocks)
        block_ids = [block.block_id for block in blocks]
        num_computed_tokens = len(block_ids) * self.block_size
        self._queries += num_tokens
        self._hits += num_computed_tokens
        return block_ids, num_computed_tokens

    def loading_prefix(self, request: Request) -> bool:
        """Whether blocks of the request's prefix are on their way from disk to the host tier (reads are
        started here); the scheduler holds the request back until they landed. False without tiers."""
        if self.tier_link is None:
            return False
        state = self._requests.setdefault(request.request_id, _RequestState())
        self._hash_full_blocks(request, state, request.num_tokens // self.block_size)
        return self.tier_link.loading(state.block_hashes[:(request.num_tokens - 1) // self.block_size])

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_block_ids: Sequence[int] | None = None) -> list[int] | None:
        """Makes room for request.num_computed_tokens + num_new_tokens tokens.

        `new_computed_block_ids` (first call after a (re)start only) come from get_computed_blocks,
        with request.num_computed_tokens already set to their token count. Returns the block ids
        appended to the request's block table, or None, with nothing changed, when blocks run out.
        """
        if (not new_computed_block_ids
                and request.num_computed_tokens + num_new_tokens <= self.fast_until.get(request.request_id, 0)):
            return []  # the last block has room and no block fills (most decode steps)
        state = self._requests.get(request.request_id)
        # A new state is stored only on success, so a refusal leaves no trace.
        state = state or _RequestState()
        computed = [self.pool.blocks[i] for i in new_computed_block_ids] if new_computed_block_ids else []
        if computed:
            if state.blocks:
                raise ValueError(f"request {request.request_id!r} already has blocks; prefix hits are "
                                 "only taken on its first allocation after a (re)start")
            if request.num_computed_tokens != len(computed) * self.block_size:
                raise ValueError(f"request {request.request_id!r} has num_computed_tokens="
                                 f"{request.num_computed_tokens} but {len(computed)} hit blocks; set it "
                                 "to the hit token count from get_computed_blocks first")
            for i, block in enumerate(computed):
                # Guards against an allocation between get_computed_blocks and here evicting a hit.
                if i >= len(state.block_hashes) or block.block_hash != state.block_hashes[i]:
                    raise ValueError(f"prefix-cache hit block {block.block_id} of request "
                                     f"{request.request_id!r} was evicted; call get_computed_blocks "
                                     "right before allocate_slots")
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        num_new_blocks = -(-num_tokens_after // self.block_size) - len(state.blocks) - len(computed)
        # Touching a free cached hit takes it out of the free queue, so it cannot also be allocated.
        num_free_hits = sum(1 for block in computed if block.ref_cnt == 0) if computed else 0
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        self._requests[request.request_id] = state
        self.pool.touch(computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        state.blocks += computed
        state.blocks += new_blocks
        if self.enable_caching:
            # Registered now, not after the step: these tokens' K/V is written by this very step,
            # before any later request can be scheduled to read it.
            num_full_blocks = min(num_tokens_after, request.num_tokens) // self.block_size
            if num_full_blocks > state.num_cached_blocks:
                self._hash_full_blocks(request, state, num_full_blocks)
                for i in range(state.num_cached_blocks, num_full_blocks):
                    self.pool.cache_full_block(state.blocks[i], state.block_hashes[i])
                state.num_cached_blocks = num_full_blocks
        # NOTE: the shortcut runs until the blocks are full, so a block that fills on a shortcut step is
        # registered by the next call here (the following step, for a decode row) or by free().
        self.fast_until[request.request_id] = len(state.blocks) * self.block_size
        return [block.block_id for block in (computed + new_blocks if computed else new_blocks)]

    def trim(self, request: Request) -> int | None:
        """Frees the request's blocks past those holding its request.num_computed_tokens tokens (the
        slots of rejected speculative positions); returns the blocks kept, or None when none was freed.

        The freed blocks were never registered in the prefix cache: registration covers full blocks of
        known tokens only (allocate_slots and free() cap it at request.num_tokens), and every known
        token's slot lies in a kept block.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            return None
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(state.blocks) <= keep:
            return None
        if state.num_cached_blocks > keep:
            raise RuntimeError(f"request {request.request_id!r}: block {state.blocks[keep].block_id} past its "
                               f"{request.num_computed_tokens} computed tokens is in the prefix cache")
        tail = state.blocks[keep:]
        del state.blocks[keep:]
        self.pool.free_blocks(reversed(tail))
        self.fast_until[request.request_id] = keep * self.block_size
        return keep

    def free(self, request: Request) -> None:
        """Releases the request's blocks, deepest first, and forgets it (a no-op when unknown).

        Blocks registered for tokens past request.num_computed_tokens (allocated for a step that the
        request was then preempted out of, before the scheduler counted the step's tokens as
        computed) leave the prefix cache: their K/V is never written.
        """
        state = self._requests.pop(request.request_id, None)
        self.fast_until.pop(request.request_id, None)
        if state is None:
            return
        if self.enable_caching:  # blocks that filled on shortcut steps since the last allocation
            num_full_blocks = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            if num_full_blocks > state.num_cached_blocks:
                self._hash_full_blocks(request, state, num_full_blocks)
                for i in range(state.num_cached_blocks, num_full_blocks):
                    self.pool.cache_full_block(state.blocks[i], state.block_hashes[i])
                state.num_cached_blocks = num_full_blocks
        for block in state.blocks[request.num_computed_tokens // self.block_size:state.num_cached_blocks]:
            self.pool.uncache_block(block)  # a fresh block of this request's: its hash is its own
        # Reverse order: the tail of a sequence is the least shareable, so it is evicted first.
        self.pool.free_blocks(reversed(state.blocks))

    def reset_prefix_cache(self) -> bool:
        """Forgets the device's cached blocks (the tiers below keep theirs); False while blocks are in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.tier_link is not None:
            self.tier_link.reset()
        return True
