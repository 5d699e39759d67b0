"""Moves KV blocks between the device cache and the host tier (core/kv_tiers), for the engine.

    engine step: schedule() -> link.take() -> run(saves, loads) -> runner.dispatch(step)
      saves: one jitted gather of the evicted blocks from every layer's cache -> [n, L, *block] on device,
             copy_to_host_async() started; poll() (later steps) hands the landed copies to the host pool
      loads: the host blocks (a numpy copy) -> one jitted scatter into every layer's cache (donated back)

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


def _time_loads(loads_done: queue.SimpleQueue, counters) -> None:
    """The load-latency watcher: (dispatch time, the scatter's readiness scalar) per step's loads, until None."""
    while (item := loads_done.get()) is not None:
        started, done = item
        done.block_until_ready()
        counters.host_load_seconds += time.perf_counter() - started
        counters.host_loads += 1


def model_identity(config: EngineConfig, model_config, block_shape: tuple[int, ...], dtype) -> bytes:
    """32 bytes naming what a block's bytes mean: the model's config and weights (config.json, each
    safetensors file's name, size and sampled contents; or the dummy weights' config), the dtype and the
    cache layout (block shape). Engines agree on it exactly when they run the same model the same way."""
    digest = hashlib.sha256(b"jaxserve.kv.model.v1")
    digest.update(repr(model_config).encode())
    digest.update(f"{np.dtype(dtype).name}|{block_shape}|{config.model.load_format}".encode())
    if config.model.load_format != "dummy":
        for path in sorted(Path(config.model.path).glob("*.safetensors")):
            size = path.stat().st_size
            digest.update(f"{path.name}|{size}".encode())
            with open(path, "rb") as f:  # a fine-tune differs from its base in every sampled window
                for offset in (0, size // 2, max(0, size - (1 << 16))):
                    f.seek(offset)
                    digest.update(f.read(1 << 16))
    return digest.digest()


def refuse_unsupported(config: EngineConfig) -> None:
    """The tiers run in one single-replica, single-process engine without speculative decoding."""
    parallel = config.parallel
    reasons = [why for bad, why in [(parallel.expert > 1, "parallel.expert > 1"),
                                    (parallel.data > 1, "parallel.data > 1 (data-parallel replicas)"),
                                    (parallel.num_processes > 1, "parallel.num_processes > 1"),
                                    (config.speculative.enabled, "speculative decoding")] if bad]
    if reasons:
        raise ValueError(f"cache.host_kv_gib / cache.disk_kv_path (KV cache tiers) are not supported yet with "
                         f"{', '.join(reasons)}; turn the tiers off (host_kv_gib: 0) or run without it")


class KVTransfer:
    def __init__(self, runner, tiers: KVTiers):
        self.runner = runner
        self.tiers = tiers
        kv = runner.kv_caches[0]
        self.axis = layers.kv_cache_axes(runner.attention_backend).index("pages")
        block_bytes = tiers.block_bytes
        self.max_move = 1 << max(0, min(6, int(math.log2(max(1, MOVE_BYTES // block_bytes)))))
        self.sizes = [1 << i for i in range(int(math.log2(self.max_move)) + 1)]
        shardings = [c.sharding for c in runner.kv_caches]
        first = shardings[0]
        scalar = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else first
        self._gather = jax.jit(functools.partial(_gather, axis=self.axis))
        self._scatter = jax.jit(functools.partial(_scatter, axis=self.axis), donate_argnums=0,
                                out_shardings=(shardings, scalar))
        self._compiled: dict[tuple[str, int], jax.stages.Compiled] = {}
        self._pending: collections.deque[tuple[list, jax.Array]] = collections.deque()
        self._data_shape = tiers.host.block_shape
        self._dtype = kv.dtype
        # Load latency (TierCounters.host_load_seconds): a watcher thread waits for each step's loads.
        self._loads_done: queue.SimpleQueue = queue.SimpleQueue()
        # (the thread holds the queue and the counters, not self: an engine dropped without close() is
        # collected, and the finalizer ends its thread)
        self._watcher = threading.Thread(target=_time_loads, args=(self._loads_done, tiers.counters),
                                         name="jaxserve-kv-loads", daemon=True)
        self._watcher.start()
        weakref.finalize(self, self._loads_done.put, None)

    @staticmethod
    def block_shape(runner) -> tuple[int, ...]:
        """One block's host shape: [L, *one layer's block] (the layout's block axis taken out)."""
        axis = layers.kv_cache_axes(runner.attention_backend).index("pages")
        shape = list(runner.kv_caches[0].shape)
        del shape[axis]
        return (len(runner.kv_caches), *shape)

    def precompile(self) -> int:
        for n in self.sizes:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            data = jax.ShapeDtypeStruct((n, *self._data_shape), self._dtype)
            self._compiled[("gather", n)] = self._gather.lower(self.runner.kv_caches, ids).compile()
            self._compiled[("scatter", n)] = self._scatter.lower(self.runner.kv_caches, ids, data).compile()
        return len(self._compiled)

    def _chunks(self, count: int):
        """(start, stop, padded size) of each program of a move of `count` blocks."""
        for start in range(0, count, self.max_move):
            stop = min(count, start + self.max_move)
            yield start, stop, next(n for n in self.sizes if n >= stop - start)

    def _ids(self, block_ids: list[int], size: int) -> np.ndarray:
        ids = np.zeros(size, np.int32)  # padding: the null block 0
        ids[:len(block_ids)] = block_ids
        return ids

    def run(self, moves: Transfers) -> None:
        """Dispatches the step's saves, then its loads; waits for neither."""
        for start, stop, size in self._chunks(len(moves.save_block_ids)):
            ids = self._ids(moves.save_block_ids[start:stop], size)
            gather = self._compiled.get(("gather", size), self._gather)
            blocks = gather(self.runner.kv_caches, ids)
            blocks.copy_to_host_async()
            self._pending.append((moves.save_keys[start:stop], blocks))
        started, done = time.perf_counter(), None
        for start, stop, size in self._chunks(len(moves.load_block_ids)):
            ids = self._ids(moves.load_block_ids[start:stop], size)
            data = np.zeros((size, *self._data_shape), self._dtype)
            data[:stop - start] = moves.load_data[start:stop]
            scatter = self._compiled.get(("scatter", size), self._scatter)
            self.runner.kv_caches, done = scatter(self.runner.kv_caches, ids, data)
        if done is not None:
            self._loads_done.put((started, done))

    def poll(self, link: TierLink, wait: bool = False) -> None:
        """Hands the save copies that landed (all of them with `wait`; the oldest beyond MAX_PENDING) to
        the host pool, and completes finished disk IO."""
        pending = self._pending
        while pending and (wait or len(pending) > MAX_PENDING or pending[0][1].is_ready()):
            keys, blocks = pending.popleft()
            link.finish_saves(keys, np.asarray(blocks)[:len(keys)])
        self.tiers.poll(wait=wait)

    def close(self, link: TierLink) -> None:
        """Shutdown: with a disk tier, every block cached on the device or present on host that the disk
        lacks is written to disk (waited for); then the load-latency watcher and the tiers' IO stop."""
        self.poll(link, wait=True)
        if self.tiers.disk is not None:
            device_only = link.device_only()
            for start, stop, size in self._chunks(len(device_only)):
                ids = self._ids([block_id for block_id, _ in device_only[start:stop]], size)
                blocks = np.asarray(self._compiled.get(("gather", size), self._gather)(self.runner.kv_caches, ids))
                for (_, key), block in zip(device_only[start:stop], blocks):
                    self.tiers.write_to_disk(key, block)
            self.tiers.flush()
        self._loads_done.put(None)
        self._watcher.join()
        self.tiers.close()


def build(config: EngineConfig, runner) -> KVTransfer | None:
    """The tiers of config.cache and their mover for `runner`'s caches; None when the tiers are off."""
    cache = config.cache
    if cache.host_kv_gib == 0:
        return None
    refuse_unsupported(config)
    shape = KVTransfer.block_shape(runner)
    dtype = np.dtype(runner.kv_caches[0].dtype)
    block_bytes = int(np.prod(shape)) * dtype.itemsize
    num_slots = int(cache.host_kv_gib * (1 << 30)) // block_bytes
    if num_slots < 1:
        raise ValueError(f"cache.host_kv_gib={cache.host_kv_gib} holds no KV block ({block_bytes} bytes each); "
                         f"raise it to at least {block_bytes / (1 << 30):.6f}")
    disk = None
    if cache.disk_kv_path is not None:
        disk = DiskKVStore(cache.disk_kv_path, int(cache.disk_kv_gib * (1 << 30)),
                           model_identity(config, runner.cfg, shape, dtype), dtype.name, shape)
    tiers = KVTiers(HostKVPool(num_slots, shape, dtype), disk, block_tokens=cache.block_size)
    return KVTransfer(runner, tiers)
