"""Paged KV-cache bookkeeping: requests' block tables, the prefix-cache hash chain, swap preemption's
blocks (host-only; no JAX). The blocks themselves: block_pool.py.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, FreeBlockQueue, KVCacheBlock
from jaxserve.core.kv_tiers.link import TierLink
from jaxserve.core.kv_tiers.tiers import TierCounters

if TYPE_CHECKING:
    from jaxserve.core.kv_tiers.tiers import KVTiers
    from jaxserve.request import Request

__all__ = ["NULL_BLOCK_ID", "BlockHash", "BlockPool", "FreeBlockQueue", "KVCacheBlock", "KVCacheManager",
           "KVCacheStats", "encode_block_key", "hash_block_builtin", "hash_block_sha256", "root_hash"]

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


def _hit_rate(stats) -> float:
    return stats.hits / stats.queries if stats.queries else 0.0


# A KV cache's counters: tokens looked up in the prefix cache (queries), of those the tokens found (hits:
# on device, or loaded back from a tier below), cached blocks whose contents were dropped to reuse the
# block (evictions), then the tiers' own (kv_tiers.tiers.TierCounters, field for field; 0 without tiers).
KVCacheStats = dataclasses.make_dataclass(
    "KVCacheStats", [("queries", int), ("hits", int), ("evictions", int),
                     *[(f.name, f.type, dataclasses.field(default=f.default))
                       for f in dataclasses.fields(TierCounters)]],
    frozen=True, namespace={"hit_rate": property(_hit_rate)}, module=__name__)


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
    def tier_usage(self) -> tuple[tuple[str, float], ...]:
        """(tier, share in use) of the device and of each tier below it."""
        return (("device", self.usage),) + (self.tiers.usage() if self.tiers is not None else ())

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
        # Registered now, not after the step: these tokens' K/V is written by this very step, before any
        # later request can be scheduled to read it.
        self._register_full_blocks(request, state, num_tokens_after)
        # NOTE: the shortcut runs until the blocks are full, so a block that fills on a shortcut step is
        # registered by the next call here (the following step, for a decode row) or by free().
        self.fast_until[request.request_id] = len(state.blocks) * self.block_size
        return [block.block_id for block in (computed + new_blocks if computed else new_blocks)]

    def _register_full_blocks(self, request: Request, state: _RequestState, num_tokens: int) -> None:
        """Offers the request's blocks that the first `num_tokens` tokens fill (known tokens only) to the
        prefix cache."""
        num_full_blocks = min(num_tokens, request.num_tokens) // self.block_size
        if self.enable_caching and num_full_blocks > state.num_cached_blocks:
            self._hash_full_blocks(request, state, num_full_blocks)
            for i in range(state.num_cached_blocks, num_full_blocks):
                self.pool.cache_full_block(state.blocks[i], state.block_hashes[i])
            state.num_cached_blocks = num_full_blocks

    def trim(self, request: Request, extra_slots: int = 0) -> int | None:
        """Frees the request's blocks past those holding its request.num_computed_tokens tokens and
        `extra_slots` more (the slots of rejected speculative positions); returns the blocks kept, or None
        when none was freed.

        The freed blocks were never registered in the prefix cache: registration covers full blocks of
        known tokens only (allocate_slots and free() cap it at request.num_tokens), and every known
        token's slot lies in a kept block.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            return None
        keep = -(-(request.num_computed_tokens + extra_slots) // self.block_size)
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
        self._register_full_blocks(request, state, request.num_computed_tokens)  # filled on shortcut steps
        for block in state.blocks[request.num_computed_tokens // self.block_size:state.num_cached_blocks]:
            self.pool.uncache_block(block)  # a fresh block of this request's: its hash is its own
        # Reverse order: the tail of a sequence is the least shareable, so it is evicted first.
        self.pool.free_blocks(reversed(state.blocks))

    # ---- swap preemption (through the host tier: kv_tiers/link.py) ----
    @property
    def can_swap(self) -> bool:
        return self.tier_link is not None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (every layer's K and V); 0 without a host tier."""
        return self.tiers.block_bytes if self.tiers is not None else 0

    def shared_prefix_tokens(self, request: Request) -> int:
        """Tokens in the request's leading blocks that other requests hold too (they stay on the device
        when this request lets go of them)."""
        state = self._requests.get(request.request_id)
        count = 0
        for block in state.blocks if state is not None else ():
            if block.ref_cnt < 2:
                break
            count += 1
        return count * self.block_size

    def swap_out(self, request: Request, num_tokens: int) -> bool:
        """Copies the blocks holding the request's first `num_tokens` tokens (a partial last block too) to
        the host tier, pinned there until swap_in; False, nothing done, when the tier lacks room. The
        caller frees the request next, as for a recompute preemption (the copies are dispatched before
        any step that could overwrite the blocks)."""
        state = self._requests.get(request.request_id)
        if self.tier_link is None or state is None or num_tokens <= 0:
            return False
        block_ids = [block.block_id for block in state.blocks[:-(-num_tokens // self.block_size)]]
        return self.tier_link.swap_out(request.request_id, block_ids, num_tokens)

    def swapped_tokens(self, request: Request) -> int:
        """Tokens of the request's K/V held on host by swap_out (0: none)."""
        return self.tier_link.swapped_tokens(request.request_id) if self.tier_link is not None else 0

    def swap_ready(self, request: Request) -> bool:
        """Whether a swapped request's blocks all reached the host (swap_in may run)."""
        return self.tier_link.swap_ready(request.request_id)

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Fresh blocks for a swapped request (request.num_computed_tokens set to swapped_tokens()) and
        `num_new_tokens` more; its host blocks are loaded into the first ones before the step. None, with
        nothing changed, when blocks run out."""
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        num_blocks = -(-num_tokens_after // self.block_size)
        if num_blocks > self.pool.num_free_blocks:
            return None
        state = self._requests[request.request_id] = _RequestState()
        state.blocks = self.pool.get_new_blocks(num_blocks)
        block_ids = [block.block_id for block in state.blocks]
        self.tier_link.swap_in(request.request_id, block_ids)
        self._register_full_blocks(request, state, num_tokens_after)
        self.fast_until[request.request_id] = num_blocks * self.block_size
        return block_ids

    def drop_swap(self, request: Request) -> None:
        """Frees the host blocks of a request that finished while swapped (a no-op otherwise)."""
        if self.tier_link is not None:
            self.tier_link.drop_swap(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forgets the device's cached blocks (the tiers below keep theirs); False while blocks are in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.tier_link is not None:
            self.tier_link.reset()
        return True
