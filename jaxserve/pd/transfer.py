"""Moving a request's KV blocks between instances: the blocks' layout, their gather and scatter, and the
host path (through host memory and the control connection; device_transfer.py has the device path).

    prefill, engine thread:  gather_chunks(block ids, chunk_sizes(n)) -> power-of-two chunks [c, L, *block]
                             on device (dispatched after the steps that wrote the blocks, reading the live
                             caches; each chunk is its own array)
    prefill, sender thread:  pack(chunks) -> bytes of exactly the n blocks, sent as a "ready" message's
                             payload; its SHA-256 and length travel in the authenticated header
    decode, control thread:  unpack(payload, n, layout) -> [n, L, *block] numpy, checked against this
                             instance's layout (block shape, dtype): a mismatch or a short payload fails
    decode, engine thread:   pieces(reserved block ids, data) -> (ids, chunk) per power-of-two chunk (host
                             bytes cut as the device path's chunks are), each written by scatter_piece into the
                             caches (donated back) before a step's forward

Both paths move the blocks as the same power-of-two chunks (no padding), so a few chunk sizes compile, all
of them at start (`BlockMover.warm`: an install that compiled would stall the decode steps behind it), and
each piece reaches the scatter as one device array on the caches' devices. The layout a block's bytes mean
is [L, *one layer's block], as the KV tiers' (runner/kv_transfer.py) whose gather and scatter are reused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import layers
from jaxserve.runner import kv_transfer


PARALLEL_CHUNKS = 16  # a long transfer travels as at least this many chunks ...
MIN_CHUNK = 8  # ... of at least this many blocks each


class TransferError(Exception):
    """A transfer that cannot be installed (wrong layout, wrong length); it resolves as failed."""


def chunk_sizes(count: int) -> list[int]:
    """`count` as powers of two, largest first (the chunks of a transfer): none above the largest power of
    two within count / PARALLEL_CHUNKS (but MIN_CHUNK), so that a long prompt's KV is many buffers, which
    the transfer server's channels move in parallel (one buffer travels over one channel) and a decode
    instance installs a few at a time; then the rest's binary digits."""
    cap = max(MIN_CHUNK, 1 << max(0, (count // PARALLEL_CHUNKS).bit_length() - 1))
    full, rest = divmod(count, cap)
    return [cap] * full + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


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

    def gather_chunks(self, block_ids: list[int], sizes: list[int]) -> list[jax.Array]:
        """The blocks as consecutive chunks of `sizes` (powers of two: no padding), each [size, L, *block] on
        this runner's first device; returns at once."""
        chunks, start = [], 0
        for size in sizes:
            chunk = self._gather(self.runner.kv_caches, np.asarray(block_ids[start: start + size], np.int32))
            chunks.append(jax.device_put(chunk, self._first_device) if self._sharded else chunk)
            start += size
        return chunks

    @staticmethod
    def pieces(block_ids: list[int], data: np.ndarray | list[jax.Array]) -> list[tuple[list[int], object]]:
        """(target block ids, blocks) per chunk: device chunks (DeviceEndpoint.pull) as they came, host bytes
        unpacked ([n, L, *block]) cut into chunk_sizes(n) views."""
        if not isinstance(data, list):
            data = np.split(data, np.cumsum(chunk_sizes(len(data)))[:-1]) if len(data) else []
        pieces, start = [], 0
        for chunk in data:
            pieces.append((block_ids[start: start + len(chunk)], chunk))
            start += len(chunk)
        return pieces

    def scatter_piece(self, block_ids: list[int], chunk) -> None:
        """Writes one piece's blocks into block_ids, in order, in every layer; returns at once. The chunk (host
        rows, or a pulled chunk on one device) is laid out over the caches' devices first."""
        chunk = jax.device_put(chunk, self._arrival)
        self.runner.kv_caches = self._scatter(self.runner.kv_caches, np.asarray(block_ids, np.int32), chunk)

    def warm(self, max_blocks: int, gather: bool, scatter: bool) -> int:
        """Compiles the programs a transfer of up to `max_blocks` blocks can run (every chunk size), by running
        each once on the null block 0 (gathered from, or zeros scattered into it: its contents are never
        read). -> programs run."""
        largest = chunk_sizes(max_blocks)[0]
        sizes = [1 << bit for bit in range(largest.bit_length())]
        # the caches as the steps leave them, committed to their devices (the same buffers): caches as
        # allocated are not, and a program's call on them would be another program
        self.runner.kv_caches = [jax.device_put(c, c.sharding) for c in self.runner.kv_caches]
        for n in sizes if gather else ():
            self.gather_chunks([0] * n, [n])
        for n in sizes if scatter else ():
            self.scatter_piece([0] * n, jnp.zeros((n, *self.block_shape), self.dtype, device=self._arrival))
        jax.block_until_ready(self.runner.kv_caches)
        return len(sizes) * (gather + scatter)


def pack(chunks: list[jax.Array]) -> bytes:
    """The chunks' blocks as bytes, in order (waits for the gathers)."""
    return b"".join(np.ascontiguousarray(np.asarray(chunk)).tobytes() for chunk in chunks)


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
