"""The GPU (Triton) ragged paged attention kernels against the pure-jnp reference.

CPU tier: interpret mode on tiny shapes (each distinct static shape or config compiles once, a few
seconds; seeds reuse the compiled function), plus a cross-lowering gate for `cuda`.
GPU tier (`-m gpu`): the compiled kernels on the device against the reference on the device.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import gpu, layout, reference

TRITON_CALL = "__gpu$xla.gpu.triton"
# The reference as one program per shape (run op by op, each of its ops would compile on its own).
reference_attention = jax.jit(reference.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window"))


@dataclasses.dataclass(frozen=True)
class Case:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"
    num_tokens: int = 32  # T, including padding token rows
    num_reqs: int = 6  # R, including padding requests (seq_len 0)
    max_blocks: int = 6
    decode_only: bool = False
    padding_reqs: int = 1  # requests at the end with no tokens (seq_len 0)


def make_batch(case: Case, seed: int):
    """A random ragged batch: decode rows, chunked prefill over a cached prefix, fresh prompts,
    a padding request and padding token rows; pages randomly permuted; every unused cache slot
    (and every page no request owns) NaN; block-table entries past a request's pages random."""
    rng = np.random.default_rng(seed)
    page, max_len = case.page_size, case.max_blocks * case.page_size
    real = case.num_reqs - case.padding_reqs  # the last requests are padding
    budget = case.num_tokens - 2  # leave padding token rows
    q_lens, seq_lens = [], []
    for r in range(real):
        kind = "decode" if case.decode_only else ("decode", "chunk", "fresh")[r % 3]
        if kind == "decode":
            q_len, context = 1, int(rng.integers(0, max_len))
        elif kind == "chunk":
            q_len, context = int(rng.integers(2, 12)), int(rng.integers(1, max_len // 2))
        else:
            q_len, context = int(rng.integers(2, 12)), 0
        q_len = max(1, min(q_len, budget - (real - r - 1), max_len - context))
        budget -= q_len
        q_lens.append(q_len)
        seq_lens.append(context + q_len)
    q_lens += [0] * case.padding_reqs
    seq_lens += [0] * case.padding_reqs

    pages_needed = [-(-s // page) for s in seq_lens]
    num_pages = case.num_reqs * case.max_blocks + 3  # fixed, so seeds share one compilation
    order = rng.permutation(num_pages)
    block_tables = rng.integers(0, num_pages, (case.num_reqs, case.max_blocks)).astype(np.int32)
    kv = np.full(layout.kv_cache_shape(num_pages, page, case.num_kv_heads, case.head_dim), np.nan,
                 np.float32)
    used = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, pages_needed)):
        block_tables[r, :n] = order[used: used + n]
        used += n
        pos = np.arange(seq_len)
        kv[:, :, block_tables[r, pos // page], pos % page] = rng.standard_normal(
            (2, case.num_kv_heads, seq_len, case.head_dim))
    q = rng.standard_normal((case.num_tokens, case.num_q_heads, case.head_dim))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    dtype = jnp.dtype(case.dtype)
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(qsl),
            jnp.asarray(seq_lens, jnp.int32), jnp.asarray(block_tables))


def check(case: Case, seeds, *, atol, sliding_window=None, config=None, interpret=True, fast_path=False):
    """`fast_path`: call with decode_only=True (the case must be decode-only)."""
    sm_scale = case.head_dim ** -0.5
    for seed in seeds:
        q, kv, qsl, seq_lens, block_tables = make_batch(case, seed)
        out = gpu.ragged_paged_attention(q, kv, qsl, seq_lens, block_tables, sm_scale=sm_scale,
                                         sliding_window=sliding_window, interpret=interpret,
                                         config=config, decode_only=fast_path)
        with jax.default_matmul_precision("highest"):  # exact float32, also on a GPU
            ref = reference_attention(
                q.astype(jnp.float32), layout.to_reference_layout(kv).astype(jnp.float32), qsl,
                seq_lens, block_tables, sm_scale=sm_scale, sliding_window=sliding_window)
        out, ref = np.asarray(out, np.float32), np.asarray(ref)
        assert out.shape == ref.shape and out.dtype == np.float32
        assert not np.isnan(out).any(), f"seed {seed}: NaN leaked into the output"
        np.testing.assert_allclose(out, ref, atol=atol, rtol=0, err_msg=f"seed {seed}")
        rows = int(qsl[-1])
        assert not out[rows:].any(), "padding token rows must be zero"


SPLIT_OFF = gpu.TuningConfig(decode_splits=1)
# Split-K with more splits than some requests have tiles (empty splits); tiles of two pages.
SPLIT_ON = gpu.TuningConfig(decode_splits=4, decode_block_kv=32, general_block_kv=32)


# ---------------------------------------------------------------------------------------------
# CPU tier: interpret mode.


@pytest.mark.parametrize("config", [SPLIT_OFF, SPLIT_ON], ids=["split_off", "split_on"])
def test_mixed_gqa4_f32(config):
    check(Case(8, 2, 64, 16), seeds=range(3), atol=2e-5, config=config)


def test_mixed_gqa8_bf16_hd128_page32():
    check(Case(8, 1, 128, 32, dtype="bfloat16", max_blocks=4), seeds=range(2), atol=3e-2)


def test_mixed_mha_sliding_window_split_on():
    check(Case(2, 2, 64, 32, max_blocks=4), seeds=range(3), atol=2e-5, sliding_window=20,
          config=SPLIT_ON)


def test_decode_only_gqa4_bf16_auto_split():
    case = Case(8, 2, 128, 16, dtype="bfloat16", num_tokens=8, num_reqs=8, max_blocks=8,
                decode_only=True)
    assert gpu.decode_splits(gpu.TuningConfig(), 8, 2, max_tiles=8) > 1  # this case splits
    check(case, seeds=range(2), atol=3e-2, config=gpu.TuningConfig(decode_block_kv=16))


@pytest.mark.parametrize("num_tokens,num_reqs,padding_reqs", [(6, 6, 1), (16, 6, 1), (4, 8, 5)],
                         ids=["T==R", "T>R", "T<R"])
def test_decode_only_fast_path(num_tokens, num_reqs, padding_reqs):
    """decode_only=True (no scatter, no general kernel) on decode batches with padding requests, and
    padding token rows past the requests (T > R) or padding requests past the tokens (T < R): the
    reference's output, padding rows zero; with a sliding window too."""
    case = Case(6, 2, 64, 16, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=4, decode_only=True,
                padding_reqs=padding_reqs)
    check(case, seeds=range(2), atol=2e-5, config=SPLIT_ON, fast_path=True)
    check(case, seeds=range(1), atol=2e-5, config=SPLIT_OFF, fast_path=True, sliding_window=20)


def test_group_not_power_of_two():
    check(Case(6, 2, 64, 16), seeds=range(2), atol=2e-5, config=SPLIT_OFF)


def test_tuning_config_validates():
    with pytest.raises(ValueError, match="power of two"):
        gpu.TuningConfig(decode_block_kv=48)
    with pytest.raises(ValueError, match="decode_splits"):
        gpu.TuningConfig(decode_splits=3)
    with pytest.raises(ValueError, match="num_warps"):
        gpu.TuningConfig(general_num_warps=3)
    hash(gpu.TuningConfig())  # static argument


def test_split_policy():
    config = gpu.TuningConfig()  # target 1024 programs, >= 4 tiles per split
    assert gpu.decode_splits(config, 64, 8, max_tiles=128) == 2
    assert gpu.decode_splits(config, 8, 8, max_tiles=512) == 16
    assert gpu.decode_splits(config, 256, 8, max_tiles=512) == 1
    assert gpu.decode_splits(config, 1, 8, max_tiles=4) == 1  # too short to split
    assert gpu.decode_splits(gpu.TuningConfig(decode_splits=8), 256, 8, max_tiles=4) == 8


def test_module_is_an_attention_backend():
    assert gpu.kv_cache_shape is layout.kv_cache_shape and gpu.write_kv is layout.write_kv


def test_lowers_for_cuda():
    """The Triton lowering accepts the kernels (power-of-two shapes, no scalar prefetch): decode,
    general, and the split-K combine where the decode kernel splits (auto: 2 splits at this shape)."""
    gdev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    sds = jax.ShapeDtypeStruct
    for window, config in ((None, None), (128, SPLIT_OFF)):
        args = (sds((64, 32, 128), jnp.bfloat16), sds((2, 8, 4096, 16, 128), jnp.bfloat16),
                sds((65,), jnp.int32), sds((64,), jnp.int32), sds((64, 256), jnp.int32))
        fn = lambda *a: gpu.ragged_paged_attention(*a, sm_scale=0.08, sliding_window=window,
                                                   config=config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend warns
            with jax.sharding.use_abstract_mesh(
                    jax.sharding.AbstractMesh((), (), abstract_device=gdev)):
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        combine = int(gpu.decode_splits(config or gpu.TuningConfig(), 64, 8, 256 // 4) > 1)
        assert combine == (config is None)
        assert text.count(TRITON_CALL) == 2 + combine, "expected the decode, the general (and combine) kernels"
        decode = jax.jit(lambda *a: gpu.ragged_paged_attention(*a, sm_scale=0.08, sliding_window=window,
                                                               config=config, decode_only=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with jax.sharding.use_abstract_mesh(
                    jax.sharding.AbstractMesh((), (), abstract_device=gdev)):
                text = decode.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count(TRITON_CALL) == 1 + combine, "decode_only launches the decode kernel (and its combine)"


# ---------------------------------------------------------------------------------------------
# GPU tier: compiled kernels on the device.

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("config", [SPLIT_OFF, None, gpu.TuningConfig(decode_splits=8)],
                         ids=["split_off", "auto", "split8"])
@pytest.mark.parametrize("case", [
    Case(32, 8, 128, 16, dtype="bfloat16", num_tokens=256, num_reqs=24, max_blocks=64),
    Case(16, 2, 64, 32, dtype="bfloat16", num_tokens=128, num_reqs=16, max_blocks=32),
    Case(32, 8, 128, 16, dtype="bfloat16", num_tokens=64, num_reqs=64, max_blocks=32,
         decode_only=True),
], ids=["gqa4_hd128_p16", "gqa8_hd64_p32", "decode64"])
def test_gpu_against_reference(case, config):
    check(case, seeds=range(2), atol=3e-2, config=config, interpret=False)
    if case.decode_only:
        check(case, seeds=range(2), atol=3e-2, config=config, interpret=False, fast_path=True)


@pytest.mark.gpu
@on_gpu
def test_gpu_float32():
    # NOTE: float32 dots in the kernel run as TF32 on the GPU (Triton's reading of DEFAULT
    # precision, like XLA's own float32 matmuls): 1.1e-3 from the exact reference was seen.
    check(Case(8, 2, 128, 16, num_tokens=128, num_reqs=12, max_blocks=32), seeds=range(2),
          atol=4e-3, interpret=False)


@pytest.mark.gpu
@on_gpu
def test_gpu_sliding_window():
    case = Case(8, 2, 128, 16, dtype="bfloat16", num_tokens=128, num_reqs=12, max_blocks=32)
    check(case, seeds=range(2), atol=3e-2, sliding_window=40, interpret=False)
