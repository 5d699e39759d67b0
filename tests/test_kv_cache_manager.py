"""KV cache manager: block pool, prefix-cache hits and isolation, and a stateful model of block contents."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.core.kv_cache_manager import (
    NULL_BLOCK_ID,
    BlockPool,
    KVCacheManager,
    encode_block_key,
    hash_block_builtin,
    hash_block_sha256,
)

pytestmark = pytest.mark.cpu_test

SEED = b"\x07" * 32


@dataclasses.dataclass
class FakeRequest:
    """The fields of jaxserve.request.Request that the manager reads."""
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_id: int | None = None
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def start(manager: KVCacheManager, request: FakeRequest, num_new_tokens: int | None = None):
    """What the scheduler does for a waiting request: look up hits, then allocate the rest."""
    hit_ids, num_hit_tokens = manager.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_ids = manager.allocate_slots(request, num_new_tokens, hit_ids)
    if new_ids is None:
        request.num_computed_tokens = 0
        return None
    request.num_computed_tokens += num_new_tokens
    return hit_ids


def make(num_blocks=16, block_size=4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, hash_seed=SEED, **kwargs)


# ---------------------------------------------------------------- block pool


def test_null_block_is_never_handed_out():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    assert sorted(block.block_id for block in blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.null_block not in list(pool.free_queue) and pool.usage == 0.0
    with pytest.raises(RuntimeError):  # double free
        pool.free_blocks(blocks[:1])


def test_free_queue_lru_order_and_touch_from_the_middle():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks([blocks[3], blocks[1], blocks[4], blocks[0], blocks[2]])
    assert [block.block_id for block in pool.free_queue] == [4, 2, 5, 1, 3]
    pool.touch([blocks[4]])  # block 5, from the middle of the queue
    assert [block.block_id for block in pool.free_queue] == [4, 2, 1, 3]
    assert [block.block_id for block in pool.get_new_blocks(2)] == [4, 2]


def test_free_releases_in_reverse_order_deepest_block_evicted_first():
    manager = make(num_blocks=5, block_size=2)  # 4 usable blocks
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    start(manager, a)
    a_ids = manager.get_block_ids("a")
    manager.free(a)
    assert [block.block_id for block in manager.pool.free_queue] == a_ids[::-1]
    # One new block evicts a's deepest full block (its partial one was never cached): 2 of 3 hit.
    start(manager, FakeRequest("x", [9]))
    assert manager.stats.evictions == 0  # the popped block (a's partial one) held no cached content
    start(manager, FakeRequest("y", [9, 9]))
    assert manager.stats.evictions == 1
    hit_ids, num_hit = manager.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5, 6, 7]))
    assert hit_ids == a_ids[:2] and num_hit == 4


def test_eviction_counter_and_least_recently_freed_go_first():
    manager = make(num_blocks=5, block_size=2)
    first, second = FakeRequest("1", [1, 1, 1]), FakeRequest("2", [2, 2, 2])
    start(manager, first)
    start(manager, second)
    manager.free(first)
    manager.free(second)
    start(manager, FakeRequest("3", [3, 3, 3]))  # pops first's two blocks; one held cached content
    assert manager.stats.evictions == 1
    assert manager.get_computed_blocks(FakeRequest("4", [1, 1, 1]))[1] == 0
    assert manager.get_computed_blocks(FakeRequest("5", [2, 2, 2]))[1] == 2


# ---------------------------------------------------------------- prefix hits


def test_hits_across_requests_sharing_a_prefix():
    manager = make()
    a = FakeRequest("a", list(range(10)))
    assert start(manager, a) == []
    b = FakeRequest("b", list(range(8)) + [99, 98, 97])
    hit_ids = start(manager, b)
    assert hit_ids == manager.get_block_ids("a")[:2] and b.num_computed_tokens == 11
    assert manager.get_block_ids("b")[:2] == hit_ids
    assert all(manager.pool.blocks[i].ref_cnt == 2 for i in hit_ids)
    assert manager.stats.queries == 21 and manager.stats.hits == 8
    assert manager.stats.hit_rate == pytest.approx(8 / 21)


def test_generated_tokens_extend_the_cache_incrementally():
    manager = make(block_size=4)
    a = FakeRequest("a", [1, 2, 3])
    start(manager, a)
    for token in [4, 5, 6, 7, 8, 9]:  # decode: one token a step
        a.all_token_ids.append(token)
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    # The block [5, 6, 7, 8] filled on a shortcut step and was registered by the next step's allocation.
    assert a.num_computed_tokens == 9 and len(manager.get_block_ids("a")) == 3
    hit_ids, num_hit = manager.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert hit_ids == manager.get_block_ids("a")[:2] and num_hit == 8


def test_a_block_filled_by_the_last_step_is_registered_on_free():
    manager = make(block_size=4)
    a = FakeRequest("a", [1, 2, 3])
    start(manager, a)
    for token in [4, 5, 6, 7, 8]:
        a.all_token_ids.append(token)
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    a.all_token_ids.append(9)  # sampled by the last step, never computed
    block_ids = manager.get_block_ids("a")
    # The step that filled [5, 6, 7, 8] took the shortcut: the block is not registered yet...
    assert manager.get_computed_blocks(FakeRequest("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == (block_ids[:1], 4)
    manager.free(a)  # ...until the request is freed
    hit_ids, num_hit = manager.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert hit_ids == block_ids and num_hit == 8


def test_hits_stop_at_the_first_miss():
    manager = make(num_blocks=6, block_size=2)
    x, y = FakeRequest("x", [1, 2, 3]), FakeRequest("y", [1, 2, 5, 6, 7])
    assert manager.get_computed_blocks(x) == manager.get_computed_blocks(y) == ([], 0)
    manager.allocate_slots(x, 3)  # registers [1, 2]
    manager.allocate_slots(y, 5)  # its [1, 2] is a duplicate (stays uncached); registers [1, 2] -> [5, 6]
    manager.free(x)
    start(manager, FakeRequest("filler", [9, 9, 9]))  # evicts x's [1, 2]; y's [5, 6] block stays cached
    assert manager.get_computed_blocks(FakeRequest("z", [1, 2, 5, 6, 7])) == ([], 0)


def test_never_all_tokens_prompt_of_exactly_k_full_blocks_hits_k_minus_1():
    manager = make(block_size=4)
    start(manager, FakeRequest("a", list(range(12))))
    b = FakeRequest("b", list(range(12)))
    hit_ids = start(manager, b)
    assert len(hit_ids) == 2 and b.num_computed_tokens == 12
    # b recomputes its last block into a fresh block; its key is a duplicate, so it stays uncached.
    assert manager.get_block_ids("b")[2] != manager.get_block_ids("a")[2]
    assert manager.pool.blocks[manager.get_block_ids("b")[2]].block_hash is None
    assert manager.get_computed_blocks(FakeRequest("c", list(range(13))))[1] == 12


@pytest.mark.parametrize("field,values,unseen", [("cache_salt", ["a", "b", None], "c"),
                                                 ("lora_id", [1, 2, None], 3)])
def test_salt_and_lora_isolate_the_cache(field, values, unseen):
    manager = make()
    tokens = list(range(9))
    for i, value in enumerate(values):
        request = FakeRequest(f"w{i}", tokens, **{field: value})
        start(manager, request)
        assert request.num_computed_tokens == 9
    for i, value in enumerate(values):  # a second request with the same key hits its own blocks only
        request = FakeRequest(f"r{i}", tokens, **{field: value})
        assert start(manager, request) == manager.get_block_ids(f"w{i}")[:2]
    assert manager.get_computed_blocks(FakeRequest("other", tokens, **{field: unseen}))[1] == 0


def test_salt_is_chained_from_the_first_block_into_later_ones():
    manager = make(block_size=2)
    start(manager, FakeRequest("a", [1, 2, 3, 4, 5], cache_salt="s"))
    # Same tokens, no salt: even the second block (whose own key has no salt field) misses.
    state_keys = set(manager.pool.cached_blocks)
    start(manager, FakeRequest("b", [1, 2, 3, 4, 5]))
    assert len(manager.pool.cached_blocks) == 2 * len(state_keys)


def test_allocation_failure_leaves_state_untouched():
    manager = make(num_blocks=6, block_size=2)  # 5 usable blocks
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6, 7])
    start(manager, a)  # 4 blocks, 3 full cached
    manager.free(a)
    holder = FakeRequest("h", [8])
    start(manager, holder)  # takes one block: 4 free, 3 of them are a's cached blocks
    b = FakeRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    hit_ids, num_hit = manager.get_computed_blocks(b)
    assert len(hit_ids) == 3 and num_hit == 6
    # b needs 2 more blocks. 4 are free, but touching its 3 free hits leaves only 1.
    snapshot = ([block.block_id for block in manager.pool.free_queue],
                [(block.ref_cnt, block.block_hash) for block in manager.pool.blocks], manager.stats.evictions)
    b.num_computed_tokens = num_hit
    assert manager.allocate_slots(b, 4, hit_ids) is None
    assert snapshot == ([block.block_id for block in manager.pool.free_queue],
                        [(block.ref_cnt, block.block_hash) for block in manager.pool.blocks],
                        manager.stats.evictions)
    assert manager.get_block_ids("b") == []
    manager.free(holder)
    assert manager.allocate_slots(b, 4, hit_ids) == hit_ids + manager.get_block_ids("b")[3:]


def test_slots_beyond_the_known_tokens_are_not_cached():
    manager = make(block_size=2)
    a = FakeRequest("a", [1, 2, 3])
    # 5 slots, 2 past the known tokens (e.g. speculative lookahead): block 1 is not full of known tokens.
    assert len(manager.allocate_slots(a, 5)) == 3 and len(manager.pool.cached_blocks) == 1
    a.num_computed_tokens = 3
    a.all_token_ids += [4, 5]
    # Block 1 is full of known tokens now; the shortcut step leaves its registration to the next
    # allocation or to free().
    assert manager.allocate_slots(a, 2) == [] and len(manager.pool.cached_blocks) == 1
    a.num_computed_tokens = 5
    manager.free(a)
    assert len(manager.pool.cached_blocks) == 2


def test_preempted_before_its_step_ran_leaves_no_unwritten_block_cached():
    manager = make(block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6, 7])
    start(manager, a, num_new_tokens=3)  # tokens 0..3 written
    assert manager.allocate_slots(a, 4) is not None  # registers [3, 4] and [5, 6] for the next step
    assert len(manager.pool.cached_blocks) == 3
    manager.free(a)  # preempted in the same schedule() call: num_computed_tokens is still 3
    a.num_computed_tokens = 0
    assert len(manager.pool.cached_blocks) == 1
    assert manager.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5, 6, 7]))[1] == 2


def test_stale_hit_is_refused():
    manager = make(num_blocks=3, block_size=2)
    a, c = FakeRequest("a", [1, 2, 3]), FakeRequest("c", [7, 7, 7])
    start(manager, a)
    manager.free(a)
    b = FakeRequest("b", [1, 2, 3])
    hit_ids, b.num_computed_tokens = manager.get_computed_blocks(b)
    start(manager, c)  # evicts the hit before b allocates
    manager.free(c)
    with pytest.raises(ValueError, match="evicted"):
        manager.allocate_slots(b, 1, hit_ids)


def test_caching_disabled_and_reset_prefix_cache():
    off = make(enable_caching=False)
    start(off, FakeRequest("a", list(range(9))))
    assert off.get_computed_blocks(FakeRequest("b", list(range(9)))) == ([], 0)
    assert not off.pool.cached_blocks

    manager = make()
    a = FakeRequest("a", list(range(9)))
    start(manager, a)
    assert not manager.reset_prefix_cache()  # blocks in use
    manager.free(a)
    manager.free(a)  # unknown now: a no-op
    assert manager.reset_prefix_cache() and manager.usage == 0.0
    assert manager.get_computed_blocks(FakeRequest("b", list(range(9))))[1] == 0


def test_sha256_and_builtin_give_the_same_hits():
    def trace(hash_algo):
        manager = make(num_blocks=10, block_size=2, hash_algo=hash_algo)
        results = []
        for i, (tokens, salt) in enumerate([([1, 2, 3, 4, 5], None), ([1, 2, 3, 9], None), ([1, 2, 3, 4, 5], "s"),
                                            ([1, 2, 3, 4, 5, 6], "s"), ([5, 5, 5, 5, 5], None), ([1, 2, 3], None)]):
            request = FakeRequest(str(i), tokens, cache_salt=salt)
            results.append((start(manager, request), manager.get_block_ids(str(i))))
            if i % 2:
                manager.free(request)
        return results, manager.stats

    assert trace("sha256") == trace("builtin")


# ---------------------------------------------------------------- hash encoding


def test_block_key_encoding_is_structured():
    parent = b"\x01" * 32
    keys = [
        encode_block_key(parent, [1, 23], None, (), None),
        encode_block_key(parent, [12, 3], None, (), None),
        encode_block_key(parent, [1, 2, 3], None, (), None),
        encode_block_key(parent, [1, 23], None, (), ""),
        encode_block_key(parent, [1, 23], None, (), "a"),
        encode_block_key(parent, [1, 23], None, (), "a1"),
        encode_block_key(parent, [1], None, (), "a"),
        encode_block_key(parent, [1, 23], 0, (), None),
        encode_block_key(parent, [1, 23], None, ("",), None),
        encode_block_key(parent, [1, 23], None, ("a", "b"), None),
        encode_block_key(parent, [1, 23], None, ("ab",), None),
        encode_block_key(parent[:31], [1, 1, 23], None, (), None),
        encode_block_key(parent + b"\x00", [23], None, (), None),
    ]
    assert len(set(keys)) == len(keys)
    assert encode_block_key(parent, [1, 23], 5, ("m",), "s") == encode_block_key(parent, (1, 23), 5, ["m"], "s")
    hashes = {hash_block_sha256(parent, t, None, (), s) for t, s in [([1, 23], None), ([12, 3], None),
                                                                      ([1, 23], "a"), ([1, 23], "")]}
    assert len(hashes) == 4 and all(len(h) == 32 for h in hashes)
    assert hash_block_builtin(parent, [1, 23], None, (), None) != hash_block_builtin(parent, [12, 3], None, (), None)


def test_root_seed_is_random_per_manager_unless_pinned():
    keys = []
    for manager in [KVCacheManager(8, 2), KVCacheManager(8, 2), make(8, 2), make(8, 2)]:
        start(manager, FakeRequest("a", [1, 2, 3, 4, 5]))
        keys.append(set(manager.pool.cached_blocks))
    assert keys[0] != keys[1] and keys[2] == keys[3]


def test_with_the_real_request_class():
    from jaxserve.request import Request
    from jaxserve.sampling_params import SamplingParams

    manager = make(block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(), cache_salt="s", lora_id=3)
    start(manager, a)
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(), cache_salt="s", lora_id=3)
    assert start(manager, b) == manager.get_block_ids("a")[:2]


# ---------------------------------------------------------------- stateful model


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / step / finish / abort / preempt / reset against a model of each block's content.

    The model records, per physical block, what the request that computed it wrote there:
    (salt, lora, the token prefix up to the end of the block). Every block a live request holds must
    hold exactly that request's prefix, so a prefix hit can only share identical salted prefixes.
    """

    @initialize(num_blocks=st.integers(4, 14), block_size=st.integers(1, 4),
                hash_algo=st.sampled_from(["sha256", "builtin"]), caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks, block_size, hash_algo, caching):
        self.manager = KVCacheManager(num_blocks, block_size, enable_caching=caching, hash_algo=hash_algo,
                                      hash_seed=SEED if hash_algo == "sha256" else None)
        self.block_size = block_size
        self.requests: dict[str, FakeRequest] = {}
        self.running: set[str] = set()
        self.content: dict[int, tuple] = {}  # block id -> (salt, lora, token prefix written)
        self.next_id = 0

    def _key(self, request: FakeRequest, num_tokens: int) -> tuple:
        return (request.cache_salt, request.lora_id, tuple(request.all_token_ids[:num_tokens]))

    # Tokens from a tiny alphabet after a few shared openings, so prefixes (and hits) collide often.
    # (Hypothesis draws the first option of sampled_from most often: make it the busy one.)
    requests_strategy = st.tuples(st.sampled_from([(0, 1, 0, 1), (1, 1, 1, 1, 0, 0), ()]),
                                  st.lists(st.integers(0, 1), max_size=6),
                                  st.sampled_from([None, None, "a", "b"]), st.sampled_from([None, None, 1]))

    @rule(new=requests_strategy)
    def add_request(self, new):
        if len(self.requests) >= 8:  # like max_num_seqs; keeps the examples fast
            return
        opening, tail, salt, lora = new
        request_id = f"r{self.next_id}"
        self.next_id += 1
        tokens = list(opening) + tail or [0]
        self.requests[request_id] = FakeRequest(request_id, tokens, cache_salt=salt, lora_id=lora)

    # NOTE: rules have no preconditions (they do nothing when there is nothing to act on): rule
    # filters that fail make Hypothesis give up on examples. Both step rules take arrivals, because
    # Hypothesis' swarm testing turns whole rules (add_request too) off in many examples.
    @rule(data=st.data(), arrivals=st.lists(requests_strategy, max_size=2))
    def step(self, data, arrivals):
        """A step with a small token budget: some requests get a chunk of their tokens, others sit out."""
        self._step(data, arrivals, chunked=True)

    @rule(data=st.data(), arrivals=st.lists(requests_strategy, max_size=2))
    def full_step(self, data, arrivals):
        """A step with an ample token budget: every request gets all its remaining tokens."""
        self._step(data, arrivals, chunked=False)

    def _step(self, data, arrivals, chunked: bool):
        for new in arrivals:
            self.add_request(new)
        for request_id in sorted(self.running) + sorted(set(self.requests) - self.running):
            if not chunked or not data.draw(st.booleans()):  # False: scheduled
                self._schedule(self.requests[request_id], data, chunked)

    def _schedule(self, request: FakeRequest, data, chunked: bool):
        manager, size = self.manager, self.block_size
        hit_ids, num_hit = [], 0
        if request.request_id not in self.running:
            hit_ids, num_hit = manager.get_computed_blocks(request)
            assert num_hit == len(hit_ids) * size and num_hit < request.num_tokens
            for i, block_id in enumerate(hit_ids):  # a hit holds exactly this request's prefix
                assert self.content.get(block_id) == self._key(request, (i + 1) * size)
            self._check_no_false_miss(request, len(hit_ids))
            event(f"prefix hit of {min(len(hit_ids), 3)}+ blocks")
            request.num_computed_tokens = num_hit
        num_remaining = request.num_tokens - request.num_computed_tokens
        num_new = data.draw(st.integers(1, num_remaining)) if chunked else num_remaining
        before = self._snapshot(request)
        new_ids = manager.allocate_slots(request, num_new, hit_ids)
        if new_ids is None:
            event("allocation refused")
            assert self._snapshot(request) == before
            if request.request_id not in self.running:
                request.num_computed_tokens = 0
            return
        self.running.add(request.request_id)
        assert new_ids[:len(hit_ids)] == hit_ids
        for block_id in new_ids[len(hit_ids):]:
            assert manager.pool.blocks[block_id].ref_cnt == 1
        if data.draw(st.integers(0, 5)) == 5:
            # Preempted later in the same schedule() call: this step never writes its K/V, and the
            # blocks registered for it must not stay cached.
            self._preempt(request)
            return
        # The step writes K/V for the new tokens into the request's blocks.
        block_ids = manager.get_block_ids(request.request_id)
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        for block_index in range(start // size, -(-end // size)):
            self.content[block_ids[block_index]] = self._key(request, min(end, (block_index + 1) * size))
        request.num_computed_tokens = end
        if end == request.num_tokens:  # the last token's logits sample the next token
            request.all_token_ids.append(data.draw(st.integers(0, 1)))

    def _check_no_false_miss(self, request: FakeRequest, num_hit_blocks: int):
        """The block after the hit run is not cached anywhere under this request's prefix."""
        if not self.manager.enable_caching or num_hit_blocks == (request.num_tokens - 1) // self.block_size:
            return
        wanted = self._key(request, (num_hit_blocks + 1) * self.block_size)
        assert all(self.content.get(block.block_id) != wanted
                   for block in self.manager.pool.cached_blocks.values())

    def _snapshot(self, request: FakeRequest):
        pool = self.manager.pool
        return ([block.block_id for block in pool.free_queue], [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                dict(pool.cached_blocks), self.manager.get_block_ids(request.request_id),
                set(self.manager._requests),
                self.manager.stats.evictions)

    def _pick(self, data, request_ids) -> FakeRequest | None:
        return self.requests[data.draw(st.sampled_from(sorted(request_ids)))] if request_ids else None

    # One rule for all three ways out, so that adds and steps are drawn as often as request ends.
    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "preempt"]))
    def end_request(self, data, how):
        request = self._pick(data, self.requests if how == "abort" else self.running)
        if request is None:
            return
        if how == "preempt":
            self._preempt(request)
        else:
            self.manager.free(request)
            self.running.discard(request.request_id)
            del self.requests[request.request_id]

    def _preempt(self, request: FakeRequest):
        self.manager.free(request)
        self.running.discard(request.request_id)
        request.num_computed_tokens = 0  # keeps its tokens and waits; recomputed (mostly from the cache) later

    @rule()
    def reset_prefix_cache(self):
        in_use = self.manager.num_free_blocks < self.manager.pool.num_blocks - 1
        assert self.manager.reset_prefix_cache() is not in_use
        if not in_use:
            assert not self.manager.pool.cached_blocks

    def teardown(self):
        event(f"evictions: {min(self.manager.stats.evictions, 5)}+")

    @invariant()
    def pool_is_consistent(self):
        manager, pool = self.manager, self.manager.pool
        holders = [0] * pool.num_blocks
        for request_id, request in self.requests.items():
            block_ids = manager.get_block_ids(request_id)
            if request_id not in self.running:
                assert block_ids == [] and request.num_computed_tokens == 0
                continue
            assert len(block_ids) == -(-request.num_computed_tokens // self.block_size)
            assert len(set(block_ids)) == len(block_ids) and NULL_BLOCK_ID not in block_ids
            for index, block_id in enumerate(block_ids):
                holders[block_id] += 1
                written = min(request.num_computed_tokens, (index + 1) * self.block_size)
                assert self.content.get(block_id) == self._key(request, written)
        assert set(manager._requests) <= set(self.requests)  # nothing kept for forgotten requests
        assert [block.ref_cnt for block in pool.blocks] == holders
        # The free queue: consistent links both ways, exactly the non-null blocks with no holder.
        forward = list(pool.free_queue)
        backward, block = [], pool.free_queue.tail.prev_free
        while block is not pool.free_queue.head:
            assert block.next_free.prev_free is block
            backward.append(block)
            block = block.prev_free
        assert forward == backward[::-1] and len(forward) == manager.num_free_blocks
        assert {b.block_id for b in forward} == {i for i in range(1, pool.num_blocks) if holders[i] == 0}
        assert len(forward) + sum(1 for h in holders if h) == pool.num_blocks - 1
        assert manager.usage == pytest.approx(1 - len(forward) / (pool.num_blocks - 1))
        # The hash map and the blocks' hashes agree; only full blocks are cached.
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash and block is not pool.null_block
            assert len(self.content[block.block_id][2]) % self.block_size == 0
        assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached_blocks)
        assert manager.enable_caching or not pool.cached_blocks


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


def test_trim_frees_the_blocks_of_rejected_guesses_and_keeps_the_cache_clean():
    manager = make(num_blocks=8, block_size=2)
    a = FakeRequest("a", [1, 2, 3])
    start(manager, a)
    a.num_computed_tokens = 3
    free_before = manager.num_free_blocks
    # A step with the last token and 4 guesses: slots for positions 2..6 (blocks 1..3).
    assert len(manager.allocate_slots(a, 5)) == 2
    a.num_computed_tokens = 8
    cached = dict(manager.pool.cached_blocks)
    assert len(cached) == 1  # only block 0 is full of known tokens: guesses are never registered
    # One guess accepted: tokens 3 and 4 known (the second one sampled), positions 0..3 computed.
    a.all_token_ids += [4, 9]
    a.num_computed_tokens = 4
    assert manager.trim(a) == 2 and manager.num_free_blocks == free_before
    assert manager.pool.cached_blocks == cached and manager.fast_until["a"] == 4
    assert manager.trim(a) is None  # nothing past the computed tokens any more
    assert manager.allocate_slots(a, 1) == [manager.get_block_ids("a")[-1]]  # position 4 needs a block again
    manager.free(a)
    assert manager.num_free_blocks == 7
