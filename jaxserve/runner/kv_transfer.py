"""Moves KV blocks between the device cache and the host tier (core/kv_tiers), for the engine.

    engine step: schedule() -> link.take() -> run(saves, loads) -> runner.dispatch(step)
      saves: one jitted gather of the evicted blocks from every layer's cache of every cache set ->
             [n, L, *block] per set on device, copy_to_host_async() started; poll() (later steps) hands the
             landed copies to the host pool, each block one row of the sets' blocks flattened end to end
      loads: the host rows (a numpy copy) -> split per set -> one jitted scatter into every layer's cache of
             every set (donated back)

The cache sets are the target model's caches and, with a draft model or an EAGLE head, the proposer's
(runner/draft_runner.py): its K/V lives in the same block ids, so a block is both sets' slices, and a host
or disk block carries the proposer's K/V with the target's. NOTE: carrying it is what keeps the proposer
right after a load; recomputing it instead cannot be done for an EAGLE head (its K/V at a position is made
from the target's hidden state there, which a loaded block skips computing), and for a draft model it would
be a draft prefill over the loaded prefix before the request's first step. A block found in a tier is so
in the state a device prefix-cache hit finds it in. Model identities include the proposer's, so engines
with another proposer (or none) never read these blocks.

Both are dispatched before the step's forward and take the caches as inputs, so the device orders them
after every earlier step and before this one (kv_tiers/link.py relies on it). Neither waits for the
device; a save's host copy is collected once its gather is done. Moves are split into programs of at
most `max_move` blocks (powers of two, padded with the null block), all compiled by precompile().
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math
import queue
import threading
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.core.kv_tiers.disk_store import DiskKVStore
from jaxserve.core.kv_tiers.host_pool import HostKVPool
from jaxserve.core.kv_tiers.link import TierLink, Transfers
from jaxserve.core.kv_tiers.tiers import KVTiers
from jaxserve.models import layers

MOVE_BYTES = 64 << 20  # the device memory one move program's blocks take at most
MAX_PENDING = 8  # save copies in flight before the oldest is waited for


def _gather(kv_caches, ids, *, axis: int):
    """[n, L, *block]: blocks `ids` of every layer, the block axis first."""
    return jnp.stack([jnp.moveaxis(jnp.take(kv, ids, axis=axis), axis, 0) for kv in kv_caches], axis=1)


def _scatter(kv_caches, ids, data, *, axis: int):
    """(the caches with `data` written into blocks `ids`, a scalar that is ready once they are)."""
    index = (slice(None),) * axis
    return [kv.at[(*index, ids)].set(jnp.moveaxis(data[:, i], 0, axis).astype(kv.dtype))
            for i, kv in enumerate(kv_caches)], ids[0]


def _shard_index(shards, ids, axis: int) -> tuple:
    """The index of blocks `ids` of expert shards `shards` in a cache whose leading axis is the shard's and
    whose block axis is `axis`: both advanced indices, so the blocks come first, [n, *the other axes]."""
    return (shards, *(slice(None),) * (axis - 1), ids)


def _gather_sets(cache_sets, ids, shards, *, axes: tuple[int, ...], sharded: bool):
    """Per cache set, its blocks `ids` as _gather's [n, L, *block] (`sharded`: of the expert shards `shards`,
    the caches' leading axis)."""
    if not sharded:
        return tuple(_gather(caches, ids, axis=axis) for caches, axis in zip(cache_sets, axes))
    return tuple(jnp.stack([kv[_shard_index(shards, ids, axis)] for kv in caches], axis=1)
                 for caches, axis in zip(cache_sets, axes))


def _scatter_sets(cache_sets, ids, shards, datas, *, axes: tuple[int, ...], sharded: bool):
    """(the cache sets with each set's `datas` written into blocks `ids` (of shards `shards` when `sharded`),
    a scalar ready once they are)."""
    if not sharded:
        out = [_scatter(caches, ids, data, axis=axis)[0] for caches, data, axis in zip(cache_sets, datas, axes)]
    else:
        out = [[kv.at[_shard_index(shards, ids, axis)].set(data[:, i].astype(kv.dtype)) for i, kv in enumerate(caches)]
               for caches, data, axis in zip(cache_sets, datas, axes)]
    return out, ids[0]


def _time_loads(loads_done: queue.SimpleQueue, counters) -> None:
    """The load-latency watcher: (dispatch time, the scatter's readiness scalar) per step's loads, until None."""
    while (item := loads_done.get()) is not None:
        started, done = item
        done.block_until_ready()
        counters.host_load_seconds += time.perf_counter() - started
        counters.host_loads += 1


def _weights_digest(digest, directory: str) -> None:
    """Each safetensors file's name, size and sampled contents (a fine-tune differs from its base in every
    sampled window)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}|{size}".encode())
        with open(path, "rb") as f:
            for offset in (0, size // 2, max(0, size - (1 << 16))):
                f.seek(offset)
                digest.update(f.read(1 << 16))


def model_identity(config: EngineConfig, model_config, block_shape: tuple[int, ...], dtype,
                   draft_config=None) -> bytes:
    """32 bytes naming what a block's bytes mean: the model's config and weights (config.json, the
    safetensors files; or the dummy weights' config), those of the draft model or EAGLE head whose K/V the
    block carries (`draft_config`, None without one), the dtype and the cache layout (block shape). Engines
    agree on it exactly when they run the same models the same way."""
    digest = hashlib.sha256(b"jaxserve.kv.model.v2")
    digest.update(repr(model_config).encode())
    digest.update(f"{np.dtype(dtype).name}|{block_shape}|{config.model.load_format}".encode())
    if config.model.load_format != "dummy":
        _weights_digest(digest, config.model.path)
    if draft_config is not None:
        digest.update(f"draft|{config.speculative.method}|{draft_config!r}".encode())
        _weights_digest(digest, config.speculative.model)
    return digest.digest()


def refuse_unsupported(config: EngineConfig) -> None:
    """The tiers run in single-process engines (data-parallel replicas and expert shards each have their
    own)."""
    parallel = config.parallel
    reasons = [why for bad, why in [(parallel.num_processes > 1, "parallel.num_processes > 1")] if bad]
    if reasons:
        raise ValueError(f"cache.host_kv_gib / cache.disk_kv_path (KV cache tiers) are not supported yet with "
                         f"{', '.join(reasons)}; turn the tiers off (host_kv_gib: 0) or run without it")


class CacheSet:
    """One set of per-layer caches that shares the block ids (the target's, a proposer's): `owner` holds
    them as `.kv_caches` (replaced by each program that writes them); a block of the set on host is
    `shape` ([L, *one layer's block]), `size` elements of a host row from `offset`. With expert shards
    (`sharded`) each array has a leading shard axis, and a block is one shard's."""

    def __init__(self, owner, offset: int, sharded: bool = False):
        self.owner = owner
        self.axis = layers.kv_cache_axes(owner.attention_backend).index("pages") + sharded
        shape = list(owner.kv_caches[0].shape)
        del shape[self.axis]
        if sharded:
            del shape[0]
        self.shape = (len(owner.kv_caches), *shape)
        self.size = int(np.prod(self.shape))
        self.offset = offset


def cache_sets(runner) -> list[CacheSet]:
    """The target's caches, then the draft model's or EAGLE head's when the runner has one."""
    owners = [runner] + [d for d in [getattr(runner, "drafter", None)] if d is not None]
    sharded = getattr(runner, "num_shards", 1) > 1
    sets, offset = [], 0
    for owner in owners:
        sets.append(CacheSet(owner, offset, sharded))
        offset += sets[-1].size
    return sets


class KVTransfer:
    def __init__(self, runner, shard_tiers: list[KVTiers]):
        """`shard_tiers`: the tiers of each expert shard's KV manager (one without expert parallelism)."""
        self.runner = runner
        self.shard_tiers = shard_tiers
        self.tiers = shard_tiers[0]  # (the only one without expert shards)
        self.sharded = len(shard_tiers) > 1
        tiers = self.tiers
        self.sets = cache_sets(runner)
        self._dtype = runner.kv_caches[0].dtype
        block_bytes = tiers.block_bytes
        self.max_move = 1 << max(0, min(6, int(math.log2(max(1, MOVE_BYTES // block_bytes)))))
        self.sizes = [1 << i for i in range(int(math.log2(self.max_move)) + 1)]
        shardings = [[c.sharding for c in s.owner.kv_caches] for s in self.sets]
        first = shardings[0][0]
        scalar = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else first
        axes = tuple(s.axis for s in self.sets)
        self._gather = jax.jit(functools.partial(_gather_sets, axes=axes, sharded=self.sharded))
        self._scatter = jax.jit(functools.partial(_scatter_sets, axes=axes, sharded=self.sharded), donate_argnums=0,
                                out_shardings=(shardings, scalar))
        self._compiled: dict[tuple[str, int], jax.stages.Compiled] = {}
        self._pending: collections.deque[tuple[list, list, tuple[jax.Array, ...]]] = collections.deque()
        # Load latency (TierCounters.host_load_seconds): a watcher thread waits for each step's loads (all
        # shards' together: counted in the first shard's counters).
        self._loads_done: queue.SimpleQueue = queue.SimpleQueue()
        # (the thread holds the queue and the counters, not self: an engine dropped without close() is
        # collected, and the finalizer ends its thread)
        self._watcher = threading.Thread(target=_time_loads, args=(self._loads_done, tiers.counters),
                                         name="jaxserve-kv-loads", daemon=True)
        self._watcher.start()
        weakref.finalize(self, self._loads_done.put, None)

    @staticmethod
    def block_shape(runner) -> tuple[int, ...]:
        """One block of the target's caches on host: [L, *one layer's block] (the layout's block axis taken
        out; pd/transfer.py's layout)."""
        return cache_sets(runner)[0].shape

    @staticmethod
    def host_shape(runner) -> tuple[int, ...]:
        """One block in the host tier: (elements of every cache set's block,), the target's first."""
        return (sum(s.size for s in cache_sets(runner)),)

    def _caches(self) -> list[list[jax.Array]]:
        return [s.owner.kv_caches for s in self.sets]

    def precompile(self) -> int:
        for n in self.sizes:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            datas = [jax.ShapeDtypeStruct((n, *s.shape), self._dtype) for s in self.sets]
            self._compiled[("gather", n)] = self._gather.lower(self._caches(), ids, ids).compile()
            self._compiled[("scatter", n)] = self._scatter.lower(self._caches(), ids, ids, datas).compile()
        return len(self._compiled)

    def _chunks(self, count: int):
        """(start, stop, padded size) of each program of a move of `count` blocks."""
        for start in range(0, count, self.max_move):
            stop = min(count, start + self.max_move)
            yield start, stop, next(n for n in self.sizes if n >= stop - start)

    def _ids(self, block_ids: list[int], size: int) -> np.ndarray:
        ids = np.zeros(size, np.int32)  # padding: the null block 0 (of shard 0)
        ids[:len(block_ids)] = block_ids
        return ids

    def _gathered(self, block_ids: list[int], shards: list[int], size: int) -> tuple[jax.Array, ...]:
        gather = self._compiled.get(("gather", size), self._gather)
        return gather(self._caches(), self._ids(block_ids, size), self._ids(shards, size))

    @staticmethod
    def _host_rows(blocks: tuple[jax.Array, ...], count: int) -> np.ndarray:
        """[count, host row]: the first `count` gathered blocks of each set, flattened and joined."""
        rows = [np.asarray(b)[:count].reshape(count, -1) for b in blocks]
        return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1)

    def run(self, moves: Transfers) -> None:
        """Dispatches the step's saves, then its loads; waits for neither."""
        for start, stop, size in self._chunks(len(moves.save_block_ids)):
            shards = moves.save_shards[start:stop]
            blocks = self._gathered(moves.save_block_ids[start:stop], shards, size)
            for b in blocks:
                b.copy_to_host_async()
            self._pending.append((moves.save_keys[start:stop], shards, blocks))
        started, done = time.perf_counter(), None
        for start, stop, size in self._chunks(len(moves.load_block_ids)):
            ids = self._ids(moves.load_block_ids[start:stop], size)
            shards = self._ids(moves.load_shards[start:stop], size)
            rows = moves.load_data[start:stop]
            datas = []
            for s in self.sets:
                data = np.zeros((size, *s.shape), self._dtype)
                data[:stop - start] = rows[:, s.offset:s.offset + s.size].reshape(stop - start, *s.shape)
                datas.append(data)
            scatter = self._compiled.get(("scatter", size), self._scatter)
            caches, done = scatter(self._caches(), ids, shards, datas)
            for s, written in zip(self.sets, caches):
                s.owner.kv_caches = written
        if done is not None:
            self._loads_done.put((started, done))

    def poll(self, link: TierLink, wait: bool = False) -> None:
        """Hands the save copies that landed (all of them with `wait`; the oldest beyond MAX_PENDING) to
        the host pool, and completes finished disk IO."""
        pending = self._pending
        while pending and (wait or len(pending) > MAX_PENDING or all(b.is_ready() for b in pending[0][2])):
            keys, shards, blocks = pending.popleft()
            link.finish_saves(keys, self._host_rows(blocks, len(keys)), shards)
        for tiers in self.shard_tiers:
            tiers.poll(wait=wait)

    def close(self, link: TierLink) -> None:
        """Shutdown: with a disk tier, every block cached on the device or present on host that the disk
        lacks is written to disk (waited for); then the load-latency watcher and the tiers' IO stop."""
        self.poll(link, wait=True)
        if self.tiers.disk is not None:
            device_only = link.device_only()
            for start, stop, size in self._chunks(len(device_only)):
                chunk = device_only[start:stop]
                blocks = self._gathered([block_id for block_id, _, _ in chunk], [shard for _, _, shard in chunk], size)
                for (_, key, shard), row in zip(chunk, self._host_rows(blocks, stop - start)):
                    self.shard_tiers[shard].write_to_disk(key, row)
            for tiers in self.shard_tiers:
                tiers.flush()
        self._loads_done.put(None)
        self._watcher.join()
        for tiers in self.shard_tiers:
            tiers.close()


def build(config: EngineConfig, runner) -> KVTransfer | None:
    """The tiers of config.cache and their mover for `runner`'s caches; None when the tiers are off."""
    cache = config.cache
    if cache.host_kv_gib == 0:
        return None
    refuse_unsupported(config)
    shape = KVTransfer.host_shape(runner)
    dtype = np.dtype(runner.kv_caches[0].dtype)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and np.dtype(drafter.kv_caches[0].dtype) != dtype:
        raise ValueError(f"speculative.model's KV cache is {np.dtype(drafter.kv_caches[0].dtype).name} but the "
                         f"target's is {dtype.name}; the KV cache tiers keep both in one block: load the draft "
                         f"in the target's dtype, or turn the tiers off (host_kv_gib: 0)")
    block_bytes = int(np.prod(shape)) * dtype.itemsize
    # Expert shards: each its own host tier, an equal share of host_kv_gib; all over one disk directory.
    shards = getattr(runner, "num_shards", 1)
    num_slots = int(cache.host_kv_gib * (1 << 30)) // shards // block_bytes
    if num_slots < 1:
        raise ValueError(f"cache.host_kv_gib={cache.host_kv_gib} holds no KV block per expert shard ({shards} "
                         f"shard(s), {block_bytes} bytes a block); raise it to at least "
                         f"{shards * block_bytes / (1 << 30):.6f}")
    identity = None
    if cache.disk_kv_path is not None:
        identity = model_identity(config, runner.cfg, shape, dtype,
                                  drafter.cfg if drafter is not None else None)
    shard_tiers = []
    for _ in range(shards):
        disk = None
        if identity is not None:
            disk = DiskKVStore(cache.disk_kv_path, int(cache.disk_kv_gib * (1 << 30)), identity, dtype.name, shape)
        shard_tiers.append(KVTiers(HostKVPool(num_slots, shape, dtype), disk, block_tokens=cache.block_size))
    return KVTransfer(runner, shard_tiers)
