"""The tiers under the device cache, as one store: the host pool, and the disk store below it.

    device block evicted --(runner: device -> host copy)--> host pool (in transit -> present)
    host block evicted (LRU) --(copied, written on the IO thread)--> disk store (a file per block)
    prefix lookup: device miss -> host present: loaded back (runner: host -> device)
                               -> on disk: read on the IO thread into a host slot (in transit), then as above

Everything but file IO runs on the engine's thread; the one IO thread runs disk reads and writes in the
order they were asked, so a read queued after a write of the same key sees the file. A block evicted from
host memory reaches the disk unless its write fails (counted), so the tiers lose a block only at the
bottom tier's cap; the host pool holds a key at most once, and so does the disk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Hashable

import numpy as np

from jaxserve.core.kv_tiers.disk_store import DiskKVStore
from jaxserve.core.kv_tiers.host_pool import HostKVPool

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TierCounters:
    """Per tier: tokens found, tokens asked for and not found (the tiers above had missed), bytes moved
    (in: written into the tier, out: read from it), blocks evicted, and loads out of it with the seconds
    they took (host: one step's host -> device copy, dispatch to done on the device; disk: one block's
    read, asked to present on host)."""

    host_hits: int = 0
    host_misses: int = 0
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    host_evictions: int = 0
    host_loads: int = 0
    host_load_seconds: float = 0.0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_bytes_in: int = 0
    disk_bytes_out: int = 0
    disk_evictions: int = 0
    disk_loads: int = 0
    disk_load_seconds: float = 0.0
    disk_errors: int = 0  # failed writes (disk full, permissions): the block is dropped
    swaps_out: int = 0  # requests preempted by swapping their blocks to host (core/preemption.py)
    swaps_in: int = 0  # of those, resumed from host


class KVTiers:
    def __init__(self, host: HostKVPool, disk: DiskKVStore | None = None, block_tokens: int = 1):
        """`block_tokens`: tokens per block (the counters count tokens)."""
        self.host = host
        self.block_tokens = block_tokens
        self.disk = disk
        self.counters = TierCounters()
        host.on_evict = self._host_evicted
        self._io = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-kv-disk")
                    if disk is not None else None)
        self._reads: dict[Hashable, concurrent.futures.Future] = {}  # disk -> host, the host key in transit
        self._writes: dict[Hashable, concurrent.futures.Future] = {}  # host -> disk

    @property
    def block_bytes(self) -> int:
        return self.host.block_bytes

    def _host_evicted(self, key: Hashable, data: np.ndarray) -> None:
        self.counters.host_evictions += 1
        if self._io is None or not isinstance(key, bytes):  # (only prefix-cache keys name disk blocks)
            return
        previous = self._writes.get(key)
        if previous is not None and not previous.done():
            return  # its write is queued already
        self._writes[key] = self._io.submit(self.disk.write, key, data)  # (the pool never writes into it)

    def locate(self, key: Hashable) -> str | None:
        """Where a block is: 'host' (present), 'moving' (in transit to the host), 'disk', or None."""
        state = self.host.state(key)
        if state != "absent":
            return "host" if state == "present" else "moving"
        if self.disk is not None and (key in self._writes or self.disk.contains(key)):
            return "disk"  # (a queued write runs before any read asked later)
        return None

    def start_read(self, key: Hashable) -> bool:
        """Starts reading a disk block into a host slot (in transit until poll() sees it done); False when
        no host slot is free."""
        if self.host.reserve(key) is None:
            return False
        self._reads[key] = self._io.submit(self._timed_read, key, time.perf_counter())
        return True

    def _timed_read(self, key: Hashable, asked: float) -> tuple[np.ndarray | None, float]:
        """(the block or None, seconds since it was asked for): runs on the IO thread."""
        block = self.disk.read(key)
        return block, time.perf_counter() - asked

    def poll(self, wait: bool = False) -> None:
        """Completes finished disk IO (every queued one with `wait`): a read block becomes present on host
        (in pinned host memory when the pool keeps its blocks there), a failed read (absent, corrupt)
        leaves the key absent."""
        if wait and self._io is not None:
            concurrent.futures.wait(list(self._reads.values()) + list(self._writes.values()))
        for key, future in [(k, f) for k, f in self._reads.items() if f.done()]:
            del self._reads[key]
            try:
                block, seconds = future.result()
            except OSError as err:
                logger.warning("KV disk tier: reading a block failed (%s); it is recomputed", err)
                block = None
            if block is not None:
                self.counters.disk_loads += 1
                self.counters.disk_load_seconds += seconds
            if block is None:
                self.host.abort(key)
                self.counters.disk_misses += self.block_tokens
            else:
                self.host.write(key, block)
                self.host.commit(key)
                self.counters.disk_bytes_out += block.nbytes
                self.counters.disk_hits += self.block_tokens
        for key, future in [(k, f) for k, f in self._writes.items() if f.done()]:
            del self._writes[key]
            try:
                if future.result():
                    self.counters.disk_bytes_in += self.block_bytes
            except OSError as err:
                self.counters.disk_errors += 1
                logger.warning("KV disk tier: writing a block failed (%s); it is dropped", err)
        if self.disk is not None:
            self.counters.disk_evictions = self.disk.num_evictions

    def write_to_disk(self, key: Hashable, block: np.ndarray) -> None:
        """Queues a disk write of `block` (numpy nobody writes into any more) under `key` (a prefix-cache
        key)."""
        if key not in self._writes and not self.disk.contains(key):
            self._writes[key] = self._io.submit(self.disk.write, key, block)

    def flush(self) -> None:
        """Writes every present host block that the disk lacks to disk and waits for every queued write
        (shutdown)."""
        host = self.host
        for key in host.keys():
            if isinstance(key, bytes):
                self.write_to_disk(key, host.row(host.lookup(key)))
        self.poll(wait=True)

    def usage(self) -> tuple[tuple[str, float], ...]:
        """(tier, share of its capacity in use) for the host tier and, when configured, the disk tier."""
        usage = (("host", self.host.usage),)
        if self.disk is not None:
            usage += (("disk", min(1.0, self.disk.used_bytes / self.disk.capacity_bytes)),)
        return usage

    def close(self) -> None:
        """Waits for queued disk IO and stops the IO thread."""
        if self._io is not None:
            self.poll(wait=True)
            self._io.shutdown(wait=True)
            self._io = None
