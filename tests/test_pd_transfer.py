"""PD KV transfer, portable path: blocks gathered on one runner's caches, packed to exactly their bytes,
unpacked and scattered into other block ids of another runner's caches arrive unchanged; a truncated
payload or a different layout fails instead of writing anything."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.pd.transfer import BlockMover, TransferError, pack, unpack


def _runner(seed: int, num_blocks: int = 16, dtype=jnp.float32):
    shape = layers.attention_backend("reference").kv_cache_shape(num_blocks, 4, 2, 8)
    rng = np.random.default_rng(seed)
    caches = [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3)]
    return types.SimpleNamespace(kv_caches=caches, attention_backend="reference")


def _block(runner, axis: int, block_id: int) -> np.ndarray:
    return np.stack([np.take(np.asarray(c), block_id, axis=axis) for c in runner.kv_caches])


def test_blocks_arrive_unchanged_at_other_ids():
    src, dst = _runner(0), _runner(1)
    p, d = BlockMover(src), BlockMover(dst)
    src_ids, dst_ids = [3, 7, 11], [5, 6, 2]
    untouched = _block(dst, d.axis, 9)
    payload = pack(p.gather(src_ids), len(src_ids))
    assert len(payload) == 3 * p.block_bytes  # exactly the blocks: no padding on the wire
    d.scatter(dst_ids, unpack(payload, 3, p.layout, d.layout))
    for s, t in zip(src_ids, dst_ids):
        np.testing.assert_array_equal(_block(dst, d.axis, t), _block(src, p.axis, s))
    np.testing.assert_array_equal(_block(dst, d.axis, 9), untouched)


def test_truncated_payload_and_layout_mismatch_fail():
    src = _runner(0)
    p = BlockMover(src)
    payload = pack(p.gather([1, 2]), 2)
    with pytest.raises(TransferError, match="truncated"):
        unpack(payload[:-1], 2, p.layout, p.layout)
    other = BlockMover(_runner(1, dtype=jnp.bfloat16))
    with pytest.raises(TransferError, match="layout mismatch"):
        unpack(payload, 2, p.layout, other.layout)
    assert pack(p.gather([]), 0) == b""
