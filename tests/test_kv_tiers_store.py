"""KV tiers on the host: the host pool and disk store as one store (property-based), the disk store's
file format and safety, and the KV cache manager writing blocks back and loading them through the tiers."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_tiers.disk_store import HEADER, DiskKVStore
from jaxserve.core.kv_tiers.host_pool import HostKVPool
from jaxserve.core.kv_tiers.tiers import KVTiers
from tests.test_kv_cache_manager import FakeRequest

pytestmark = pytest.mark.cpu_test

SHAPE = (2, 3)
MODEL = b"m" * 32


def key_of(i: int) -> bytes:
    return i.to_bytes(32, "little")


def block_of(key: bytes) -> np.ndarray:
    """Each key's own content, so a block served under the wrong key shows."""
    return np.frombuffer(key[:4] * 6, np.float32).reshape(SHAPE).copy() + np.arange(6, dtype=np.float32).reshape(SHAPE)


def to_pinned(row: np.ndarray):
    """A host block as the GPU engine keeps it: a jax Array of its own in pinned host memory."""
    import jax
    from jax.sharding import SingleDeviceSharding

    return jax.device_put(row, SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


def make_tiers(tmp, host_slots: int, disk_blocks: int | None, block_tokens: int = 2, pinned: bool = False) -> KVTiers:
    disk = None
    if disk_blocks is not None:
        disk = DiskKVStore(str(tmp), disk_blocks * (HEADER.size + 24), MODEL, "float32", SHAPE)
    host = HostKVPool(host_slots, SHAPE, np.float32, place=to_pinned if pinned else None)
    return KVTiers(host, disk, block_tokens=block_tokens)


class TiersMachine(RuleBasedStateMachine):
    """Blocks written back into the host tier, evicted down to disk, read back up: every block found is
    the one written under its key, the host holds each key once within its slots, the disk stays within
    its cap, and with a disk larger than every block nothing written is ever lost; with the host blocks in
    pinned host memory (`pinned`) as with numpy ones."""

    @initialize(host_slots=st.integers(1, 4), disk_blocks=st.sampled_from([None, 3, 64]), pinned=st.booleans())
    def setup(self, host_slots, disk_blocks, pinned):
        self.dir = tempfile.mkdtemp(prefix="jaxserve-kv-")
        os.chmod(self.dir, 0o700)
        self.tiers = make_tiers(self.dir, host_slots, disk_blocks, pinned=pinned)
        self.pinned = pinned
        self.disk_blocks = disk_blocks
        self.written: set[bytes] = set()
        self.transit: list[bytes] = []

    def teardown(self):
        if hasattr(self, "tiers"):
            self.tiers.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(i=st.integers(0, 12))
    def start_save(self, i):
        key = key_of(i)
        if self.tiers.host.reserve(key) is not None:
            self.transit.append(key)

    @precondition(lambda self: self.transit)
    @rule(data=st.data(), ok=st.booleans())
    def finish_save(self, data, ok):
        key = self.transit.pop(data.draw(st.integers(0, len(self.transit) - 1)))
        if ok:
            self.tiers.host.write(key, block_of(key))
            self.tiers.host.commit(key)
            self.written.add(key)
        else:
            self.tiers.host.abort(key)

    @rule(i=st.integers(0, 12), wait=st.booleans())
    def lookup(self, i, wait):
        key = key_of(i)
        where = self.tiers.locate(key)
        if where == "host":
            slot = self.tiers.host.lookup(key)
            assert np.array_equal(self.tiers.host.read([slot])[0], block_of(key))
        elif where == "disk":
            self.tiers.start_read(key)
        self.tiers.poll(wait=wait)

    @invariant()
    def consistent(self):
        if not hasattr(self, "tiers"):
            return
        host = self.tiers.host
        host.check()
        assert host.num_present + host.num_in_transit <= host.num_slots
        for key in host.keys():
            assert np.array_equal(host.row(host.lookup(key)), block_of(key))
            block = host.blocks([host.lookup(key)])[0]
            assert isinstance(block, np.ndarray) != self.pinned
            if self.pinned:
                assert block.sharding.memory_kind == "pinned_host"
        disk = self.tiers.disk
        if disk is not None:
            files = disk._scan()[0]
            assert len(files) * disk.file_bytes <= disk.capacity_bytes
            assert disk.num_corrupt == 0

    def check_nothing_lost(self):
        self.tiers.poll(wait=True)
        if self.disk_blocks == 64:
            for key in self.written:
                where = self.tiers.locate(key)
                assert where in ("host", "moving", "disk"), key
                if where == "disk":
                    assert np.array_equal(self.tiers.disk.read(key), block_of(key))

    @rule()
    def nothing_lost(self):
        self.check_nothing_lost()


TiersMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                          suppress_health_check=list(HealthCheck))
test_tiers_machine = TiersMachine.TestCase


# ---------------------------------------------------------------- disk store


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "kv"
    return path


def test_disk_store_round_trip_is_private_and_shared_between_stores(store_dir):
    a = DiskKVStore(str(store_dir), 1 << 20, MODEL, "float32", SHAPE)
    b = DiskKVStore(str(store_dir), 1 << 20, MODEL, "float32", SHAPE)  # another engine process
    assert a.write(key_of(1), block_of(key_of(1))) and not a.write(key_of(1), block_of(key_of(1)))
    assert np.array_equal(b.read(key_of(1)), block_of(key_of(1)))
    assert b.read(key_of(2)) is None
    path = a._path(key_of(1))
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700 and stat.S_IMODE(a.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    raw = path.read_bytes()
    assert raw[:8] == b"JAXSKV01" and len(raw) == HEADER.size + 24  # a fixed header, then the raw block
    # another model, or another dtype, never reads these blocks
    assert DiskKVStore(str(store_dir), 1 << 20, b"n" * 32, "float32", SHAPE).read(key_of(1)) is None
    assert DiskKVStore(str(store_dir), 1 << 20, MODEL, "float16", SHAPE).read(key_of(1)) is None
    assert np.array_equal(a.read(key_of(1)), block_of(key_of(1)))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend", "wrong_key", "chmod"])
def test_a_damaged_block_file_is_a_miss_and_is_deleted(store_dir, damage):
    store = DiskKVStore(str(store_dir), 1 << 20, MODEL, "float32", SHAPE)
    store.write(key_of(1), block_of(key_of(1)))
    store.write(key_of(2), block_of(key_of(2)))
    path = store._path(key_of(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-1] ^= 1
    elif damage == "flip_header":
        raw[20] ^= 1  # the payload size
    elif damage == "truncate":
        raw = raw[:-5]
    elif damage == "extend":
        raw += b"\0"
    elif damage == "wrong_key":  # a valid file of another block under this block's name
        raw = bytearray(store._path(key_of(2)).read_bytes())
    if damage == "chmod":
        path.chmod(0o644)
    else:
        path.write_bytes(bytes(raw))
    assert store.read(key_of(1)) is None and not path.exists() and store.num_corrupt == 1
    assert np.array_equal(store.read(key_of(2)), block_of(key_of(2)))


def test_a_writer_killed_mid_write_leaves_no_block_that_loads(store_dir):
    store = DiskKVStore(str(store_dir), 1 << 20, MODEL, "float32", SHAPE)
    path = store._path(key_of(1))
    path.parent.mkdir(mode=0o700)
    tmp = path.parent / f".tmp-999-1-{path.name}"  # what a writer leaves when killed before its rename
    tmp.write_bytes(b"JAXSKV01" + b"\0" * 10)
    assert store.read(key_of(1)) is None and not store.contains(key_of(1))
    os.utime(tmp, (0, 0))  # stale: the next store to start removes it
    DiskKVStore(str(store_dir), 1 << 20, MODEL, "float32", SHAPE)
    assert not tmp.exists()


def test_disk_store_refuses_a_directory_others_can_write_and_keeps_its_cap(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(ValueError, match="cache.disk_kv_path .* is writable by group or others"):
        DiskKVStore(str(shared), 1 << 20, MODEL, "float32", SHAPE)
    with pytest.raises(ValueError, match="raise cache.disk_kv_gib"):
        DiskKVStore(str(tmp_path / "small"), 10, MODEL, "float32", SHAPE)
    store = DiskKVStore(str(tmp_path / "kv"), 5 * (HEADER.size + 24), MODEL, "float32", SHAPE)
    for i in range(12):
        store.write(key_of(i), block_of(key_of(i)))
        os.utime(store._path(key_of(i)), (i, i))  # distinct mtimes: LRU by mtime
    assert len(store._scan()[0]) <= 5 and store.num_evictions >= 7
    assert store.contains(key_of(11)) and not store.contains(key_of(0))


# ---------------------------------------------------------------- the manager through the tiers


class FakeDevice:
    """The device cache as block id -> the token prefix it holds; transfers move those contents."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager
        self.content: dict[int, tuple] = {}
        self.ids: dict[tuple, int] = {}  # prefix -> a number, the host pool's block content

    def encode(self, prefix: tuple) -> np.ndarray:
        number = self.ids.setdefault(prefix, len(self.ids) + 1)
        return np.full(SHAPE, number, np.float32)

    def decode(self, block: np.ndarray) -> tuple:
        number = int(block[0, 0])
        return next(prefix for prefix, n in self.ids.items() if n == number)

    def transfer(self) -> None:
        link = self.manager.tier_link
        moves = link.take()
        assert link.load_budget is None or len(moves.load_block_ids) <= link.load_budget
        saved = np.stack([self.encode(self.content[b]) for b in moves.save_block_ids]) if moves.save_block_ids else None
        for block_id, block in zip(moves.load_block_ids, moves.load_data if moves.load_data is not None else []):
            self.content[block_id] = self.decode(block)
        if saved is not None:  # (landing later than the loads is the runner's order too)
            link.finish_saves(moves.save_keys, saved)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompts=st.lists(st.tuples(st.sampled_from([(0, 1, 0, 1, 1, 0), (1, 1, 1, 1), ()]),
                                  st.lists(st.integers(0, 2), max_size=8), st.sampled_from([None, "s"])),
                        min_size=1, max_size=14),
       num_blocks=st.integers(3, 8), host_slots=st.integers(1, 6), disk=st.booleans(),
       load_budget=st.sampled_from([None, 1, 2]))
def test_manager_hits_through_the_tiers_hold_their_prefix(prompts, num_blocks, host_slots, disk, load_budget):
    """Requests one at a time on a small device pool: every hit, from device, host or disk, holds the
    request's own prefix; evicted blocks come back from the tiers below; with a load budget no step
    carries more loads than it (a waiting request's host blocks load over several steps)."""
    size = 2
    directory = tempfile.mkdtemp(prefix="jaxserve-kv-")
    tiers = make_tiers(directory, host_slots, 64 if disk else None)
    manager = KVCacheManager(num_blocks, size, hash_seed=5, tiers=tiers)
    manager.tier_link.load_budget = load_budget
    device = FakeDevice(manager)
    try:
        for i, (opening, tail, salt) in enumerate(prompts):
            tokens = (list(opening) + tail)[:(num_blocks - 1) * size] or [0]
            request = FakeRequest(f"r{i}", tokens, cache_salt=salt)
            for _ in range(3 + num_blocks):  # reads start, land (a prefix longer than the host stops at its
                if not manager.loading_prefix(request):  # size); host blocks load a budget per step
                    break
                tiers.poll(wait=True)
                device.transfer()
            else:
                raise AssertionError(f"request {i} is still loading after its reads landed")
            hit_ids, num_hit = manager.get_computed_blocks(request)
            request.num_computed_tokens = num_hit
            new_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hit_ids)
            assert new_ids is not None
            device.transfer()  # before the step: saves of evicted blocks, loads of tier hits
            for j, block_id in enumerate(hit_ids):
                assert device.content[block_id] == (salt, tuple(tokens[:(j + 1) * size])), (i, j)
            for j, block_id in enumerate(manager.get_block_ids(request.request_id)):
                if j >= len(hit_ids):  # the step computes the rest
                    device.content[block_id] = (salt, tuple(tokens[:(j + 1) * size]))
            request.num_computed_tokens = request.num_tokens
            manager.free(request)
            tiers.host.check()
        device.transfer()
        tiers.poll(wait=True)
        stats = manager.stats
        assert stats.host_hits == stats.host_bytes_out // tiers.block_bytes * size  # each load counted once
    finally:
        tiers.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_an_evicted_prefix_comes_back_from_host_then_from_disk(tmp_path):
    size = 2
    tiers = make_tiers(tmp_path / "kv", 2, 64)
    manager = KVCacheManager(4, size, hash_seed=5, tiers=tiers)  # 3 usable device blocks
    device = FakeDevice(manager)

    def run(tokens):
        request = FakeRequest(str(tokens), tokens)
        while manager.loading_prefix(request):
            tiers.poll(wait=True)
        hit_ids, num_hit = manager.get_computed_blocks(request)
        request.num_computed_tokens = num_hit
        assert manager.allocate_slots(request, len(tokens) - num_hit, hit_ids) is not None
        device.transfer()
        for j, block_id in enumerate(manager.get_block_ids(request.request_id)):
            if j >= len(hit_ids):
                device.content[block_id] = (None, tuple(tokens[:(j + 1) * size]))
        request.num_computed_tokens = len(tokens)
        manager.free(request)
        return num_hit

    a, b, c, d = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20]
    run(a)
    run(b)  # a's blocks leave the device for the host
    assert run(a) == 4 and manager.stats.host_hits == 4 and manager.stats.disk_hits == 0
    for tokens in (b, c, d):  # the host (2 slots) overflows: the oldest blocks go to disk
        run(tokens)
    tiers.poll(wait=True)
    assert tiers.counters.disk_bytes_in > 0
    assert run(a) == 4 and manager.stats.disk_hits == 4 and manager.stats.host_hits == 8
    tiers.close()
