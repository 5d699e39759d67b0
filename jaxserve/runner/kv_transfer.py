"""Moves KV blocks between the device cache and the host tier (core/kv_tiers), for the engine.

    engine step: schedule() -> link.take() -> run(saves, loads) -> runner.dispatch(step)
      saves: one jitted gather of the evicted blocks from every layer's cache of every cache set, each block
             one host row (the sets' blocks flattened end to end); poll() (later steps) hands the landed
             copies to the host pool
      loads: the host rows -> one jitted scatter, which splits each row per set and writes it into every
             layer's cache of every set (donated back); prefix loads at most LOAD_BYTES_PER_STEP a step
             per KV manager (the link holds a longer host prefix's request until its blocks are loaded:
             kv_tiers/link.py)

Where the host tier's blocks live (`pinned_sharding`):
    pinned host memory (GPUs; single-device caches): each block is its own "pinned_host" jax Array. The
        copies happen inside the move programs: the gather's outputs, one per block, live in pinned host
        memory, and the scatter takes the blocks' pinned arrays as arguments and copies them to the device
        itself. Both are plain DMA copies queued like any program, so the engine's loop never waits for
        the device, and a move of n blocks is one call, not n transfers of its own. (A device_put to
        pinned memory, by contrast, returns only once its source is computed. One pinned pool array would
        not do: XLA updates it in place only as host compute over the whole pool, and gathers from it
        slowly.) XLA's pinned pool grows by pinning fresh memory (cudaHostAlloc), seconds per few GiB, so
        build() pins the host tier's bytes once when the engine starts (reserve_pinned) instead of in the
        middle of serving.
    numpy (CPU; caches over several devices: a tensor-parallel block is sharded over its heads, which a
        flat host row does not follow; a host tier too big for XLA's pinned pool, see build()): the
        gather's blocks [n, L, *block] per set are copied to host with copy_to_host_async() and joined
        into numpy rows; a load stacks the rows, splits them per set and hands them to the scatter, whose
        call copies them to the device.

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
device; a save's host copy is collected once it landed. Moves are split into programs of at
most `max_move` blocks (powers of two, padded with the null block), all compiled by precompile().
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import math
import os
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

logger = logging.getLogger(__name__)

MOVE_BYTES = 64 << 20  # the device memory one move program's blocks take at most
MAX_MOVE_BLOCKS = 64  # and its blocks at most
MAX_PENDING = 8  # save copies in flight before the oldest is waited for
LOAD_BYTES_PER_STEP = 1 << 30  # host -> device prefix loads one step carries at most (TierLink.load_budget)
# The share of XLA's pinned host pool that host tiers may take (XLA stages host -> device copies there too)
PINNED_POOL_SHARE = 0.9


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


def _gather_rows(cache_sets, ids, shards, *, axes: tuple[int, ...], sharded: bool):
    """_gather_sets' blocks as one device array per block: its host row (the sets' blocks flattened, joined
    in set order)."""
    blocks = _gather_sets(cache_sets, ids, shards, axes=axes, sharded=sharded)
    rows = jnp.concatenate([b.reshape(b.shape[0], -1) for b in blocks], axis=1)
    return tuple(rows[i] for i in range(rows.shape[0]))


def _scatter_rows(cache_sets, ids, shards, rows, *, axes: tuple[int, ...], sharded: bool,
                  shapes: tuple[tuple[int, ...], ...], on_device):
    """_scatter_sets of pinned host rows (one array per block), moved to `on_device` first, each split into
    the sets' blocks of `shapes` (in row order)."""
    rows = jnp.stack([jax.device_put(row, on_device) for row in rows])
    datas, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        datas.append(rows[:, offset:offset + size].reshape(rows.shape[0], *shape))
        offset += size
    return _scatter_sets(cache_sets, ids, shards, datas, axes=axes, sharded=sharded)


@functools.lru_cache(maxsize=None)
def _move_programs(axes: tuple[int, ...], sharded: bool, shapes: tuple[tuple[int, ...], ...],
                   shardings: tuple[tuple, ...], scalar, pinned, sizes: tuple[int, ...]) -> dict:
    """The gather and scatter programs of one cache layout (the sets' block axes and block shapes, the
    caches' shardings), made once per process: every KVTransfer of that layout (engines built again, data
    parallel replicas in one process) runs the same jits, so each program compiles once.

    pinned None: "gather" and "scatter" of device arrays. Else one gather and one pinned scatter per move
    size n ("gathers", "pinned_scatters": their outputs or arguments are n pinned rows); "gather" and
    "scatter" are unused. (A bare device, or a sharding without a memory kind, would
    keep the pinned arrays' memory.)"""
    layout = dict(axes=axes, sharded=sharded)
    caches = [list(s) for s in shardings]
    if pinned is None:
        return {"gather": jax.jit(functools.partial(_gather_sets, **layout)),
                "scatter": jax.jit(functools.partial(_scatter_sets, **layout), donate_argnums=0,
                                   out_shardings=(caches, scalar))}
    on_device = pinned.with_memory_kind("device")
    return {
        "gather": None,
        "scatter": None,
        "gathers": {n: jax.jit(functools.partial(_gather_rows, **layout), out_shardings=(pinned,) * n)
                    for n in sizes},
        "pinned_scatters": {
            n: jax.jit(functools.partial(_scatter_rows, **layout, shapes=shapes, on_device=on_device),
                       donate_argnums=0, in_shardings=(caches, scalar, scalar, (pinned,) * n),
                       out_shardings=(caches, scalar)) for n in sizes},
    }


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


def uses_pinned_host(device) -> bool:
    """Whether the host tier keeps its blocks in `device`'s pinned host memory: on GPUs that have it.
    (CPU JAX has a "pinned_host" memory too: tests patch this function to run that path on a CPU.)"""
    return device.platform == "gpu" and "pinned_host" in [m.kind for m in device.addressable_memories()]


def pinned_pool_bytes() -> int:
    """XLA's pool of pinned host memory on a GPU, which every "pinned_host" array of the process comes out
    of: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (XLA's own setting, read as XLA reads it), 64 GiB unset."""
    try:
        return int(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) << 30
    except ValueError:
        return 64 << 30


def pinned_sharding(runner):
    """The sharding of a host block in pinned host memory (on the caches' device), or None where the host
    tier keeps numpy rows: without pinned host memory, and for caches over several devices (tensor
    parallel: a block is sharded over its heads, which one flat host row per block does not follow)."""
    caches = [cache for s in cache_sets(runner) for cache in s.owner.kv_caches]
    devices = {device for cache in caches for device in cache.sharding.device_set}
    if len(devices) != 1 or not uses_pinned_host(next(iter(devices))):
        return None
    sharding = caches[0].sharding
    replicated = NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else sharding
    return replicated.with_memory_kind("pinned_host")


def reserve_pinned(nbytes: int, pinned, chunk_bytes: int = 1 << 30) -> None:
    """Grows XLA's pinned host pool by `nbytes` now: chunks of zeros copied to `pinned` memory, held
    together, then dropped. The pool keeps the memory it pinned, so the host tier's blocks later come out
    of it without pinning more."""
    chunk_bytes = min(chunk_bytes, nbytes)
    if chunk_bytes <= 0:
        return
    started = time.perf_counter()
    zeros = jax.jit(lambda: jnp.zeros((chunk_bytes,), jnp.uint8), out_shardings=pinned.with_memory_kind("device"))()
    held = [jax.device_put(zeros, pinned) for _ in range(-(-nbytes // chunk_bytes))]
    jax.block_until_ready(held)
    logger.info("pinned %.1f GiB of host memory for the KV host tier in %.1f s", nbytes / (1 << 30),
                time.perf_counter() - started)


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
    def __init__(self, runner, shard_tiers: list[KVTiers], pinned=None):
        """`shard_tiers`: the tiers of each expert shard's KV manager (one without expert parallelism).
        `pinned`: pinned_sharding(runner) when the host pools keep pinned arrays (their `place` puts rows
        there), None: numpy rows."""
        self.runner = runner
        self.shard_tiers = shard_tiers
        self.tiers = shard_tiers[0]  # (the only one without expert shards)
        self.sharded = len(shard_tiers) > 1
        self.pinned = pinned
        tiers = self.tiers
        self.sets = cache_sets(runner)
        self._dtype = runner.kv_caches[0].dtype
        self.row_size = sum(s.size for s in self.sets)
        block_bytes = tiers.block_bytes
        self.max_move = 1 << int(math.log2(max(1, min(MAX_MOVE_BLOCKS, MOVE_BYTES // block_bytes))))
        self.sizes = [1 << i for i in range(int(math.log2(self.max_move)) + 1)]
        self.load_budget = max(1, LOAD_BYTES_PER_STEP // block_bytes)  # (per expert shard's link)
        shardings = [[c.sharding for c in s.owner.kv_caches] for s in self.sets]
        first = shardings[0][0]
        scalar = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else first
        shapes = tuple(s.shape for s in self.sets)
        programs = _move_programs(tuple(s.axis for s in self.sets), self.sharded, shapes,
                                  tuple(tuple(s) for s in shardings), scalar, pinned, tuple(self.sizes))
        self._gather, self._scatter = programs["gather"], programs["scatter"]
        if pinned is not None:
            self._gathers, self._pinned_scatters = programs["gathers"], programs["pinned_scatters"]
            self._zero_row = jax.device_put(np.zeros(self.row_size, self._dtype), pinned)  # (padding)
        self._compiled: dict[tuple[str, int], jax.stages.Compiled] = {}
        # (keys, shards, the save's arrays: gathered blocks on their way to numpy, or pinned rows)
        self._pending: collections.deque[tuple[list, list, list[jax.Array]]] = collections.deque()
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
            if self.pinned is None:
                datas = [jax.ShapeDtypeStruct((n, *s.shape), self._dtype) for s in self.sets]
            else:
                datas = (jax.ShapeDtypeStruct((self.row_size,), self._dtype, sharding=self.pinned),) * n
            self._compiled[("gather", n)] = self._gather_program(n).lower(self._caches(), ids, ids).compile()
            self._compiled[("scatter", n)] = self._scatter_program(n).lower(self._caches(), ids, ids,
                                                                            datas).compile()
        self._warm()
        return len(self._compiled)

    def _warm(self) -> None:
        """Runs each move program once on the null block 0 (gathered from, then zeros scattered into it,
        as padding does) and waits: a GPU executable loads its kernels on its first run, and a load that
        came during serving would wait for the step in flight (runner/precompile.py, warm)."""
        for n in self.sizes:
            zeros = np.zeros(n, np.int32)
            jax.block_until_ready(self._compiled[("gather", n)](self._caches(), zeros, zeros))
            if self.pinned is not None:
                datas = (self._zero_row,) * n
            else:
                datas = [np.zeros((n, *s.shape), self._dtype) for s in self.sets]
            caches, done = self._compiled[("scatter", n)](self._caches(), zeros, zeros, datas)
            for s, written in zip(self.sets, caches):
                s.owner.kv_caches = written
            jax.block_until_ready(caches)

    def _gather_program(self, n: int):
        return self._gather if self.pinned is None else self._gathers[n]

    def _scatter_program(self, n: int):
        return self._scatter if self.pinned is None else self._pinned_scatters[n]

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
        """The gather's outputs: [size, L, *block] per set (numpy path) or `size` pinned rows."""
        gather = self._compiled.get(("gather", size)) or self._gather_program(size)
        return gather(self._caches(), self._ids(block_ids, size), self._ids(shards, size))

    def _host_rows(self, gathered, count: int) -> list[np.ndarray]:
        """The first `count` gathered blocks as numpy host rows (each set's block flattened, joined)."""
        if self.pinned is not None:
            return [np.asarray(row) for row in gathered[:count]]
        rows = [np.asarray(b)[:count].reshape(count, -1) for b in gathered]
        return list(rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1))

    def run(self, moves: Transfers) -> None:
        """Dispatches the step's saves, then its loads; waits for neither."""
        saves = []
        for start, stop, size in self._chunks(len(moves.save_block_ids)):
            shards = moves.save_shards[start:stop]
            saves.append((moves.save_keys[start:stop], shards,
                          self._gathered(moves.save_block_ids[start:stop], shards, size)))
        if self.pinned is None:
            for keys, shards, blocks in saves:
                for b in blocks:
                    b.copy_to_host_async()
                self._pending.append((keys, shards, list(blocks)))
        elif saves:  # (one pending entry per step, however many programs its saves took)
            self._pending.append(([key for keys, _, _ in saves for key in keys],
                                  [shard for _, shards, _ in saves for shard in shards],
                                  [row for keys, _, rows in saves for row in rows[:len(keys)]]))
        if not moves.load_block_ids:
            return
        started, done = time.perf_counter(), None
        blocks = moves.load_data
        for start, stop, size in self._chunks(len(moves.load_block_ids)):
            ids = self._ids(moves.load_block_ids[start:stop], size)
            shards = self._ids(moves.load_shards[start:stop], size)
            scatter = self._compiled.get(("scatter", size)) or self._scatter_program(size)
            if self.pinned is not None:
                datas = (*blocks[start:stop], *(self._zero_row,) * (size - (stop - start)))
            else:
                rows = np.stack(blocks[start:stop])
                datas = []
                for s in self.sets:
                    data = np.zeros((size, *s.shape), self._dtype)
                    data[:stop - start] = rows[:, s.offset:s.offset + s.size].reshape(stop - start, *s.shape)
                    datas.append(data)
            caches, done = scatter(self._caches(), ids, shards, datas)
            for s, written in zip(self.sets, caches):
                s.owner.kv_caches = written
        self._loads_done.put((started, done))

    def poll(self, link: TierLink, wait: bool = False) -> None:
        """Hands the save copies that landed (all of them with `wait`; the oldest beyond MAX_PENDING) to
        the host pool (pinned arrays as they are, else numpy rows), and completes finished disk IO."""
        pending = self._pending
        def landed(arrays) -> bool:  # (the last array first: a save still in flight costs one check, not one per row)
            return arrays[-1].is_ready() and all(b.is_ready() for b in arrays)

        while pending and (wait or len(pending) > MAX_PENDING or landed(pending[0][2])):
            keys, shards, arrays = pending.popleft()
            if self.pinned is not None:
                jax.block_until_ready(arrays)  # (landed: a waited poll returns with every save in host memory)
            link.finish_saves(keys, arrays if self.pinned is not None else self._host_rows(arrays, len(keys)), shards)
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
                gathered = self._gathered([block_id for block_id, _, _ in chunk], [shard for _, _, shard in chunk],
                                          size)
                for (_, key, shard), row in zip(chunk, self._host_rows(gathered, stop - start)):
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
    pinned = pinned_sharding(runner)
    # (data-parallel replicas run in one process: their host tiers share XLA's one pinned pool)
    tier_bytes = num_slots * shards * block_bytes * config.parallel.data
    if pinned is not None and tier_bytes > PINNED_POOL_SHARE * pinned_pool_bytes():
        logger.warning("cache.host_kv_gib=%s (x %d data-parallel replica(s)) is over %.0f%% of XLA's pinned host "
                       "memory pool (%.0f GiB): the host tier keeps its blocks in pageable memory, where copies to "
                       "and from the device are several times slower; lower host_kv_gib, or raise the pool with "
                       "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", cache.host_kv_gib, config.parallel.data,
                       100 * PINNED_POOL_SHARE, pinned_pool_bytes() / (1 << 30))
        pinned = None
    if pinned is not None:
        reserve_pinned(tier_bytes // config.parallel.data, pinned)
    place = None if pinned is None else functools.partial(jax.device_put, device=pinned)  # (disk -> host)
    shard_tiers = []
    for _ in range(shards):
        disk = None
        if identity is not None:
            disk = DiskKVStore(cache.disk_kv_path, int(cache.disk_kv_gib * (1 << 30)), identity, dtype.name, shape)
        shard_tiers.append(KVTiers(HostKVPool(num_slots, shape, dtype, place=place), disk,
                                   block_tokens=cache.block_size))
    return KVTransfer(runner, shard_tiers, pinned)
