"""Moving a request's KV blocks between instances: the blocks' layout, their gather and scatter, and the
host path (through host memory and the control connection; device_transfer.py has the device path).

    prefill, engine thread:  gather(block ids) -> [n, L, *block] on device (dispatched after the steps that
                             wrote the blocks, reading the live caches; the copy is its own array)
    prefill, sender thread:  pack(copy, n) -> bytes of exactly n blocks (no padding), sent as a "ready"
                             message's payload; its SHA-256 and length travel in the authenticated header
    decode, control thread:  unpack(payload, n, layout) -> [n, L, *block] numpy, checked against this
                             instance's layout (block shape, dtype): a mismatch or a short payload fails
    decode, engine thread:   scatter(reserved block ids, data) -> the caches (donated back), before the next
                             step's forward

Device programs take a power-of-two number of blocks (padded with the null block 0, whose contents are
never read), so a few sizes compile, all of them at start (`BlockMover.warm`: an install that compiled
would stall the decode steps behind it); the bytes on the wire are the request's blocks only. Both paths'
blocks reach the scatter as one device array on the caches' devices, so they share its programs. The layout
a block's bytes mean is [L, *one layer's block], as the KV tiers' (runner/kv_transfer.py) whose gather and
scatter are reused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import layers
from jaxserve.runner import kv_transfer


class TransferError(Exception):
    """A transfer that cannot be installed (wrong layout, wrong length); it resolves as failed."""


def _bucket(count: int) -> int:
    return 1 << (max(count, 1) - 1).bit_length()


class BlockMover:
    """Gathers and scatters whole blocks of one runner's KV caches (engine thread only)."""

    def __init__(self, runner):
        self.runner = runner
        self.axis = layers.kv_cache_axes(runner.attention_backend).index("pages")
        self.block_shape = kv_transfer.KVTransfer.block_shape(runner)
        self.dtype = np.dtype(runner.kv_caches[0].dtype)
        shardings = [cache.sharding for cache in runner.kv_caches]
        sharding = shardings[0]
        self._first_device = jax.sharding.SingleDeviceSharding(min(sharding.device_set, key=lambda d: d.id))
        self._sharded = len(sharding.device_set) > 1
        # where the scatter takes its blocks: laid out over the caches' devices, or on the one device
        self._arrival = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
                         if self._sharded else self._first_device)
        self._gather = jax.jit(functools.partial(kv_transfer._gather, axis=self.axis))
        self._scatter = jax.jit(lambda caches, ids, data: kv_transfer._scatter(caches, ids, data, axis=self.axis)[0],
                                donate_argnums=0, out_shardings=shardings)

    @property
    def first_device(self) -> jax.Device:
        return self._first_device.device_set.copy().pop()

    @property
    def layout(self) -> dict:
        """What a block's bytes mean here; the sender's must be equal."""
        return {"block_shape": list(self.block_shape), "dtype": self.dtype.name}

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def gather(self, block_ids: list[int]) -> jax.Array:
        """[bucket, L, *block] copy of the blocks (first len(block_ids) rows); returns at once."""
        ids = np.zeros(_bucket(len(block_ids)), np.int32)
        ids[:len(block_ids)] = block_ids
        return self._gather(self.runner.kv_caches, ids)

    def gather_chunks(self, block_ids: list[int], sizes: list[int]) -> list[jax.Array]:
        """The blocks as consecutive chunks of `sizes` (powers of two: no padding), each [size, L, *block] on
        this runner's first device; returns at once."""
        chunks, start = [], 0
        for size in sizes:
            chunk = self._gather(self.runner.kv_caches, np.asarray(block_ids[start: start + size], np.int32))
            chunks.append(jax.device_put(chunk, self._first_device) if self._sharded else chunk)
            start += size
        return chunks

    def scatter(self, block_ids: list[int], data: np.ndarray | list[jax.Array]) -> None:
        """Writes the blocks into block_ids, in order, in every layer; returns at once. `data`: host bytes
        unpacked ([n, L, *block]) or device chunks of power-of-two sizes (DeviceEndpoint.pull)."""
        if isinstance(data, list):
            start = 0
            for chunk in data:
                ids = np.asarray(block_ids[start: start + len(chunk)], np.int32)
                if self._sharded:  # pulled onto one device: laid out over the caches' devices first
                    chunk = jax.device_put(chunk, self._arrival)
                self.runner.kv_caches = self._scatter(self.runner.kv_caches, ids, chunk)
                start += len(chunk)
            return
        size = _bucket(len(block_ids))
        ids = np.zeros(size, np.int32)
        ids[:len(block_ids)] = block_ids
        padded = np.zeros((size, *self.block_shape), self.dtype)
        padded[:len(block_ids)] = data
        self.runner.kv_caches = self._scatter(self.runner.kv_caches, ids,
                                              jax.device_put(padded, self._arrival))

    def warm(self, max_blocks: int, gather: bool, scatter: bool, host_path: bool) -> int:
        """Compiles the programs a request of up to `max_blocks` blocks can run, by running each once on the
        null block 0 (gathered from, or zeros scattered into it: padding writes it anyway): the device path's
        chunk sizes, and with `host_path` every padded size up to max_blocks' power of two. -> programs run."""
        from jaxserve.pd.device_transfer import chunk_sizes  # noqa: PLC0415 - it imports this module
        largest = _bucket(max_blocks) if host_path else chunk_sizes(max_blocks)[0]
        sizes = [1 << bit for bit in range(largest.bit_length())]
        # the caches as the steps leave them, committed to their devices (the same buffers): caches as
        # allocated are not, and a program's call on them would be another program
        self.runner.kv_caches = [jax.device_put(c, c.sharding) for c in self.runner.kv_caches]
        for n in sizes if gather else ():
            self.gather_chunks([0] * n, [n])
        for n in sizes if scatter else ():
            zeros = jnp.zeros((n, *self.block_shape), self.dtype, device=self._arrival)
            self.runner.kv_caches = self._scatter(self.runner.kv_caches, np.zeros(n, np.int32), zeros)
        jax.block_until_ready(self.runner.kv_caches)
        return len(sizes) * (gather + scatter)


def pack(gathered: jax.Array, count: int) -> bytes:
    """The first `count` blocks' bytes (waits for the gather)."""
    return np.ascontiguousarray(np.asarray(gathered)[:count]).tobytes() if count else b""


def unpack(payload: bytes, count: int, sender_layout: dict, layout: dict) -> np.ndarray:
    """`count` blocks from `payload`; TransferError when the sender's layout differs or the length is wrong."""
    if sender_layout != layout:
        raise TransferError(f"KV layout mismatch: the prefill instance sends {sender_layout}, this instance "
                            f"holds {layout}; run both with the same model, dtype and block size")
    shape = (count, *layout["block_shape"])
    dtype = np.dtype(jnp.dtype(layout["dtype"]))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(payload) != expected:
        raise TransferError(f"KV payload of {len(payload)} bytes for {count} blocks; expected {expected} "
                            f"(truncated transfer)")
    return np.frombuffer(payload, dtype).reshape(shape)
