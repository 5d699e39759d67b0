"""Moving a request's KV blocks device to device through `jax.experimental.transfer` (the default path;
transfer.py's host path is the other).

    prefill, engine thread:  the blocks gathered as power-of-two chunks ([c, L, *block], one device each, no
                             padding: 13 blocks are chunks of 8, 4 and 1; a long prompt's blocks are cut
                             into at least PARALLEL_CHUNKS of them), registered under a fresh random
                             uuid with this process's transfer server; the "ready" message carries
                             {address, uuid, chunks} instead of the bytes
    decode, control thread:  pulls the chunks onto its first device, waits for them against the transfer's
                             deadline and checks each (an errored array must never reach the caches: written
                             into them it would poison every later read)
    decode, engine thread:   the chunks, laid out like the caches, scattered into the reserved blocks

Each chunk is its own buffer, so the server's channels move them in parallel. The transfer server's own
timeouts are lazy and `connect()` to a dead address never fails, so every wait here polls readiness
against our deadline; a connection that failed or timed out is dropped and rebuilt on next use (a peer
that went away poisons it for good). A registered chunk stays in the server's table until pulled: the
prefill side keeps its own reference until the transfer resolves.

The endpoint authenticates nothing: anyone who can reach it and guesses a live 63-bit uuid may pull
those blocks. It binds to server.kv_transfer_address's host, which must be loopback or a private
network (as the control endpoint).
"""

from __future__ import annotations

import secrets
import threading
import time

import jax
import numpy as np

from jaxserve.pd.transfer import TransferError

CHANNELS = 4  # bulk-transport sockets per server: chunks travel over them in parallel
MAX_CHUNKS = 64  # a "ready" names at most this many chunks (chunk_sizes: < 2 x PARALLEL_CHUNKS full + 31 binary)
_POLL_S = 0.001


def check_chunks(chunks, count: int) -> list[int]:
    """A "ready" message's chunk sizes, checked: powers of two, at most MAX_CHUNKS, summing to `count`."""
    if (not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS
            or not all(isinstance(c, int) and c > 0 and c & (c - 1) == 0 for c in chunks) or sum(chunks) != count):
        raise TransferError(f"chunks {chunks!r} are not powers of two summing to num_blocks={count}")
    return chunks


class DeviceEndpoint:
    """This process's transfer server on `device`, bound to `host` (any free ports), and its connections."""

    def __init__(self, device: jax.Device, host: str):
        from jax.experimental import transfer  # noqa: PLC0415 - only instances that move KV start a server
        self.device = device
        # Non-empty transport addresses: an empty list selects an in-process transport, which across
        # processes fails (and aborts the process).
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"] * CHANNELS)
        self.address = self.server.address()
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, chunks: list[jax.Array]) -> int:
        """Registers `chunks` for one pull; -> their uuid. The caller keeps them referenced until resolved."""
        uuid = secrets.randbits(63)
        self.server.await_pull(uuid, chunks)
        return uuid

    def pull(self, address: str, uuid: int, chunks: list[int], block_shape: tuple[int, ...], dtype: np.dtype,
             deadline: float) -> list[jax.Array]:
        """The chunks registered under `uuid` at `address`, complete and checked, on this endpoint's
        device; TransferError when they fail or are not all there by `deadline` (time.monotonic())."""
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct((size, *block_shape), dtype, sharding=sharding) for size in chunks]
        connection = self._connection(address)
        try:
            arrays = connection.pull(uuid, specs)
            while not all(array.is_ready() for array in arrays):
                if time.monotonic() >= deadline:
                    raise TransferError(f"the KV pull from {address} did not complete in time")
                time.sleep(_POLL_S)
            for array in arrays:  # an errored array is "ready" too: reading it raises
                array.block_until_ready()
        except TransferError:
            self._drop(address, connection)
            raise
        except Exception as err:  # noqa: BLE001 - XLA's runtime errors (peer gone, size mismatch) end the transfer
            self._drop(address, connection)
            raise TransferError(f"the KV pull from {address} failed: {err}") from None
        return arrays

    def _connection(self, address: str):
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self.server.connect(address)
            return connection

    def _drop(self, address: str, connection) -> None:
        with self._lock:
            if self._connections.get(address) is connection:
                del self._connections[address]
