"""FP8 KV cache (cache.kv_cache_dtype: fp8): the quantizing write, the kernels against the reference on
fp8 caches (interpret mode), and the engine's accuracy and composition with an fp8 cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import fp8, gpu, layout, reference
from tests.test_paged_attention_gpu import SPLIT_OFF, SPLIT_ON, Case, make_batch


def _fp8_batch(case: Case, seed: int):
    """make_batch's batch with its cache scaled by random per-(K/V, kv head) scales and stored as fp8
    (NaN in unused slots stays NaN), and those scales [2, K]."""
    q, kv, qsl, seq_lens, block_tables = make_batch(case, seed)
    scales = jnp.asarray(np.random.default_rng(seed).uniform(0.02, 0.2, (2, case.num_kv_heads)), jnp.float32)
    kv8 = fp8.quantize(kv.astype(jnp.float32) * 3.0, scales[:, :, None, None, None])
    return q, kv8, scales, qsl, seq_lens, block_tables


def test_quantize_saturates_and_keeps_three_mantissa_bits():
    x = jnp.asarray([0.0, 1.0, -1.0, 1e6, -1e6, 300.0, 0.3, 1.0625], jnp.float32)
    out = np.asarray(fp8.quantize(x, jnp.float32(0.5)).astype(jnp.float32))
    np.testing.assert_array_equal(out[:6], [0.0, 2.0, -2.0, 448.0, -448.0, 448.0])  # clipped, never NaN
    assert abs(out[6] - 0.6) / 0.6 <= 1 / 16  # round to nearest of 3 mantissa bits
    assert out[7] == 2.0  # 2.125 rounds to even


@pytest.mark.parametrize("write_kv, shape", [(layout.write_kv, layout.kv_cache_shape),
                                             (reference.write_kv, reference.kv_cache_shape)],
                         ids=["layout", "reference"])
def test_write_kv_quantizes_by_head_scale(write_kv, shape):
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((5, 2, 16)) * 4, jnp.bfloat16) for _ in range(2))
    scales = jnp.asarray([[0.5, 2.0], [1.0, 0.25]], jnp.float32)
    cache = jnp.zeros(shape(4, 4, 2, 16), fp8.DTYPE)
    slots = jnp.asarray([4, 5, 6, 9, 15])
    out = write_kv(cache, k, v, slots, kv_scale=scales)
    assert out.dtype == fp8.DTYPE
    ref_layout = out if write_kv is reference.write_kv else layout.to_reference_layout(out)
    flat = np.asarray(ref_layout.astype(jnp.float32)).reshape(2, 16, 2, 16)  # [2, slots, K, H]
    for i, x in enumerate((k, v)):
        want = np.asarray(fp8.quantize(x, scales[i][None, :, None]).astype(jnp.float32))
        np.testing.assert_array_equal(flat[i, np.asarray(slots)], want)
        dequant = flat[i, np.asarray(slots)] * np.asarray(scales[i])[None, :, None]
        np.testing.assert_allclose(dequant, np.asarray(x, np.float32), rtol=1 / 15, atol=2e-3 * 2)


def test_reference_dequantizes_by_scale():
    """The reference over an fp8 cache equals the reference over that cache's values times its scales."""
    case = Case(8, 2, 32, 16)
    q, kv8, scales, qsl, seq_lens, block_tables = _fp8_batch(case, 0)
    ref_kv = layout.to_reference_layout(kv8)
    got = reference.ragged_paged_attention(q, ref_kv, qsl, seq_lens, block_tables, sm_scale=0.2, kv_scale=scales)
    dequant = ref_kv.astype(jnp.float32) * scales[:, None, None, :, None]
    want = reference.ragged_paged_attention(q, dequant, qsl, seq_lens, block_tables, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert not np.isnan(np.asarray(got)).any()


@pytest.mark.parametrize("case, config, fast_path", [
    (Case(8, 2, 32, 16, dtype="bfloat16"), SPLIT_OFF, False),
    (Case(4, 2, 32, 16, dtype="bfloat16", max_blocks=4), SPLIT_ON, False),
    (Case(8, 2, 32, 16, dtype="bfloat16", decode_only=True, num_tokens=8, num_reqs=6), SPLIT_ON, True),
], ids=["mixed", "mixed_split", "decode_only_split"])
def test_gpu_kernels_read_fp8_like_the_reference(case, config, fast_path):
    sm_scale = case.head_dim ** -0.5
    for seed in range(2):
        q, kv8, scales, qsl, seq_lens, block_tables = _fp8_batch(case, seed)
        out = gpu.ragged_paged_attention(q, kv8, qsl, seq_lens, block_tables, sm_scale=sm_scale, interpret=True,
                                         config=config, decode_only=fast_path, kv_scale=scales)
        with jax.default_matmul_precision("highest"):
            ref = reference.ragged_paged_attention(q, layout.to_reference_layout(kv8), qsl, seq_lens, block_tables,
                                                   sm_scale=sm_scale, kv_scale=scales)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert not np.isnan(out).any(), f"seed {seed}: NaN leaked into the output"
        np.testing.assert_allclose(out, ref, atol=3e-2, rtol=2e-2, err_msg=f"seed {seed}")  # bf16 output ulps
        assert not out[int(qsl[-1]):].any(), "padding token rows must be zero"
