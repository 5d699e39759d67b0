"""PD KV transfer. Host path: blocks gathered on one runner's caches, packed to exactly their bytes,
unpacked and scattered into other block ids of another runner's caches arrive unchanged; a truncated
payload or a different layout fails instead of writing anything. Device path: the same blocks as
power-of-two chunks pulled by another transfer server; a pull that never completes fails at its deadline.
After warm-up neither path compiles."""

from __future__ import annotations

import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.pd.transfer import BlockMover, TransferError, chunk_sizes, pack, unpack
from tests.conftest import ROOT


def _runner(seed: int, num_blocks: int = 16, dtype=jnp.float32):
    shape = layers.attention_backend("reference").kv_cache_shape(num_blocks, 4, 2, 8)
    rng = np.random.default_rng(seed)
    caches = [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3)]
    return types.SimpleNamespace(kv_caches=caches, attention_backend="reference")


def _scatter(mover: BlockMover, block_ids: list[int], data) -> None:
    """Every piece of `data` written into block_ids at once (as a decode instance's installs, unpaced)."""
    for ids, chunk in mover.pieces(block_ids, data):
        mover.scatter_piece(ids, chunk)


def _block(runner, axis: int, block_id: int) -> np.ndarray:
    return np.stack([np.take(np.asarray(c), block_id, axis=axis) for c in runner.kv_caches])


def test_blocks_arrive_unchanged_at_other_ids():
    src, dst = _runner(0), _runner(1)
    p, d = BlockMover(src), BlockMover(dst)
    src_ids, dst_ids = [3, 7, 11], [5, 6, 2]
    untouched = _block(dst, d.axis, 9)
    payload = pack(p.gather_chunks(src_ids, chunk_sizes(3)))
    assert len(payload) == 3 * p.block_bytes  # exactly the blocks: no padding on the wire
    _scatter(d, dst_ids, unpack(payload, 3, p.layout, d.layout))
    for s, t in zip(src_ids, dst_ids):
        np.testing.assert_array_equal(_block(dst, d.axis, t), _block(src, p.axis, s))
    np.testing.assert_array_equal(_block(dst, d.axis, 9), untouched)


def test_truncated_payload_and_layout_mismatch_fail():
    src = _runner(0)
    p = BlockMover(src)
    payload = pack(p.gather_chunks([1, 2], [2]))
    with pytest.raises(TransferError, match="truncated"):
        unpack(payload[:-1], 2, p.layout, p.layout)
    other = BlockMover(_runner(1, dtype=jnp.bfloat16))
    with pytest.raises(TransferError, match="layout mismatch"):
        unpack(payload, 2, p.layout, other.layout)
    assert pack([]) == b""


# ---- the device path (jax.experimental.transfer) --------------------------------------------------------------
def test_long_transfers_travel_as_many_chunks():
    """A long prompt's blocks are cut into at least PARALLEL_CHUNKS power-of-two chunks (the transfer
    server's channels each move whole buffers), every split sums to its count within MAX_CHUNKS."""
    from jaxserve.pd.device_transfer import MAX_CHUNKS, check_chunks
    from jaxserve.pd.transfer import PARALLEL_CHUNKS
    assert chunk_sizes(512) == [512 // PARALLEL_CHUNKS] * PARALLEL_CHUNKS
    assert chunk_sizes(3) == [2, 1]
    for count in [*range(1, 2100), 2**20 - 1]:
        chunks = chunk_sizes(count)
        assert check_chunks(chunks, count) == chunks and len(chunks) <= MAX_CHUNKS
        assert count < 16 * PARALLEL_CHUNKS or len(chunks) >= PARALLEL_CHUNKS


def test_device_path_moves_exactly_the_blocks_as_power_of_two_chunks():
    """13 blocks travel as chunks of 8, 4 and 1 (no padding), pulled by another transfer server onto its
    device and scattered into other block ids; blocks outside them are untouched."""
    import jax

    from jaxserve.pd.device_transfer import DeviceEndpoint
    src, dst = _runner(0, num_blocks=32), _runner(1, num_blocks=32)
    p, d = BlockMover(src), BlockMover(dst)
    src_ids, dst_ids = list(range(2, 28, 2)), list(range(30, 17, -1))
    assert chunk_sizes(13) == [8, 4, 1]
    chunks = p.gather_chunks(src_ids, chunk_sizes(13))
    producer, consumer = DeviceEndpoint(jax.devices()[0], "127.0.0.1"), DeviceEndpoint(jax.devices()[0], "127.0.0.1")
    uuid = producer.offer(chunks)
    untouched = _block(dst, d.axis, 5)
    pulled = consumer.pull(producer.address, uuid, [8, 4, 1], d.block_shape, d.dtype, time.monotonic() + 30)
    _scatter(d, dst_ids, pulled)
    for s, t in zip(src_ids, dst_ids):
        np.testing.assert_array_equal(_block(dst, d.axis, t), _block(src, p.axis, s))
    np.testing.assert_array_equal(_block(dst, d.axis, 5), untouched)


@pytest.mark.parametrize("split", ["decode", "prefill"])
def test_device_path_between_instances_split_differently_by_kv_head(split):
    """parallel.model = 1 feeds model = 2 and the reverse: chunks travel from one device (a split sender
    gathers them there) and are laid out over the receiving caches' devices on arrival."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxserve.pd.device_transfer import DeviceEndpoint
    src, dst = _runner(0), _runner(1)
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    heads = NamedSharding(mesh, PartitionSpec(*[("model" if a == "kv_heads" else None)
                                               for a in layers.kv_cache_axes("reference")]))
    split_runner = dst if split == "decode" else src
    split_runner.kv_caches = [jax.device_put(c, heads) for c in split_runner.kv_caches]
    p, d = BlockMover(src), BlockMover(dst)
    assert p.layout == d.layout  # the global block shape: the split is the receiver's business
    endpoint = DeviceEndpoint(jax.devices()[0], "127.0.0.1")
    src_ids, dst_ids = [1, 2, 3], [9, 4, 12]
    pulled = endpoint.pull(endpoint.address, endpoint.offer(p.gather_chunks(src_ids, chunk_sizes(3))), [2, 1],
                           d.block_shape, d.dtype, time.monotonic() + 30)
    _scatter(d, dst_ids, pulled)
    assert all(c.sharding.is_equivalent_to(heads, c.ndim) for c in split_runner.kv_caches)
    for s, t in zip(src_ids, dst_ids):
        np.testing.assert_array_equal(_block(dst, d.axis, t), _block(src, p.axis, s))


def test_chunk_lists_other_than_a_power_of_two_split_are_refused():
    from jaxserve.pd.device_transfer import check_chunks
    assert check_chunks([8, 4, 1], 13) == [8, 4, 1]
    for bad in ([8, 4], [3, 10], [8, 4, 1, 0], "13", [2.0, 1]):
        with pytest.raises(TransferError, match="powers of two"):
            check_chunks(bad, 13)


_UNANSWERED_PULL = """
import os, sys, time
import jax, numpy as np
from jaxserve.pd.device_transfer import DeviceEndpoint
from jaxserve.pd.transfer import TransferError
producer, consumer = (DeviceEndpoint(jax.devices()[0], "127.0.0.1") for _ in range(2))
gone = "127.0.0.1:" + sys.argv[1]  # nothing listens there
for address in (producer.address, gone):  # a uuid never offered; a peer that is gone
    start = time.monotonic()
    try:
        consumer.pull(address, 12345, [2], (3, 4), np.dtype(np.float32), start + 1.0)
    except TransferError as err:
        print(f"{time.monotonic() - start:.1f}", err, flush=True)
os._exit(0)  # the abandoned pulls never finish: leave without waiting for them
"""


def test_device_pull_that_never_completes_fails_at_its_deadline():
    """A pull of a uuid nobody offers, or from a peer that is gone, never completes by itself (the
    transfer server retries a dead address for ever): it fails at our deadline, and the engine goes on."""
    import subprocess
    import sys

    from tests.pd_fault_proxy import free_port
    result = subprocess.run([sys.executable, "-c", _UNANSWERED_PULL, str(free_port())], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("did not complete in time" in line for line in lines), result.stdout + result.stderr
    assert all(1.0 <= float(line.split()[0]) < 10.0 for line in lines), lines


@pytest.mark.parametrize("split", [False, True])
def test_warmed_movers_never_compile_a_transfer(split):
    """After BlockMover.warm, gathers and installs of any length up to its max_blocks, on either path and
    into caches split by KV head, trace nothing; the null block is the only block warm-up wrote."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxserve.pd.device_transfer import DeviceEndpoint
    src, dst = _runner(0, num_blocks=32), _runner(1, num_blocks=32)
    if split:
        mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
        heads = NamedSharding(mesh, PartitionSpec(*[("model" if a == "kv_heads" else None)
                                                   for a in layers.kv_cache_axes("reference")]))
        dst.kv_caches = [jax.device_put(c, heads) for c in dst.kv_caches]
    p, d = BlockMover(src), BlockMover(dst)
    before = [_block(dst, d.axis, b) for b in range(1, 32)]
    assert not src.kv_caches[0].committed  # as an engine allocates them; its steps return them committed
    assert p.warm(20, gather=True, scatter=False) == 4  # 1, 2, 4, 8: chunk_sizes(20) = [8, 8, 4]
    assert d.warm(20, gather=False, scatter=True) == 4
    for b, block in enumerate(before, start=1):
        np.testing.assert_array_equal(_block(dst, d.axis, b), block)
    endpoint = DeviceEndpoint(jax.devices()[0], "127.0.0.1")
    assert src.kv_caches[0].committed and dst.kv_caches[0].committed
    with jax.no_tracing():
        for count in (1, 3, 13, 20):
            src_ids, dst_ids = list(range(1, count + 1)), list(range(31, 31 - count, -1))
            sizes = chunk_sizes(count)
            pulled = endpoint.pull(endpoint.address, endpoint.offer(p.gather_chunks(src_ids, sizes)), sizes,
                                   d.block_shape, d.dtype, time.monotonic() + 30)
            _scatter(d, dst_ids, pulled)
            for s, t in zip(src_ids, dst_ids):
                np.testing.assert_array_equal(_block(dst, d.axis, t), _block(src, p.axis, s))
            _scatter(d, dst_ids[::-1], unpack(pack(p.gather_chunks(src_ids, sizes)), count, p.layout, d.layout))
            for s, t in zip(src_ids, dst_ids[::-1]):
                np.testing.assert_array_equal(_block(dst, d.axis, t), _block(src, p.axis, s))
