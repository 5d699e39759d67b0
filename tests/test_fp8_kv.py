"""FP8 KV cache (cache.kv_cache_dtype: fp8): the quantizing write, the kernels against the reference on
fp8 caches (interpret mode), and the engine's accuracy and composition with an fp8 cache."""

from __future__ import annotations

import dataclasses

import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, load_config
from jaxserve.models import kv_scales, llama_hf, loader
from jaxserve.runner import device_setup
from pallas_kernels.paged_attention import fp8, gpu, layout, reference
from tests import reference_generate
from tests.conftest import ROOT, TINY_MODEL
from tests.test_paged_attention_gpu import SPLIT_OFF, SPLIT_ON, Case, make_batch, reference_attention
from tools.train_tiny import held_out_problems

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


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
    got = reference_attention(q, ref_kv, qsl, seq_lens, block_tables, sm_scale=0.2, kv_scale=scales)
    dequant = ref_kv.astype(jnp.float32) * scales[:, None, None, :, None]
    want = reference_attention(q, dequant, qsl, seq_lens, block_tables, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert not np.isnan(np.asarray(got)).any()


DECODE_ONLY = Case(8, 2, 32, 16, dtype="bfloat16", decode_only=True, num_tokens=8, num_reqs=6)


@pytest.mark.parametrize("case, config, fast_path", [
    (Case(8, 2, 32, 16, dtype="bfloat16"), SPLIT_OFF, False),
    (DECODE_ONLY, dataclasses.replace(SPLIT_ON, decode_fp8_block_kv=32, decode_fp8_dots="q"), True),
    (DECODE_ONLY, dataclasses.replace(SPLIT_ON, decode_fp8_block_kv=32), True),
], ids=["mixed", "decode_only_split_q_dots", "decode_only_split_float16_dots"])  # (split-K partials: the decode-only case)
def test_gpu_kernels_read_fp8_like_the_reference(case, config, fast_path):
    sm_scale = case.head_dim ** -0.5
    for seed in range(1):  # (one compile per case: keep it to one seed)
        q, kv8, scales, qsl, seq_lens, block_tables = _fp8_batch(case, seed)
        out = gpu.ragged_paged_attention(q, kv8, qsl, seq_lens, block_tables, sm_scale=sm_scale, interpret=True,
                                         config=config, decode_only=fast_path, kv_scale=scales)
        with jax.default_matmul_precision("highest"):
            ref = reference_attention(q, layout.to_reference_layout(kv8), qsl, seq_lens, block_tables,
                                      sm_scale=sm_scale, kv_scale=scales)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert not np.isnan(out).any(), f"seed {seed}: NaN leaked into the output"
        np.testing.assert_allclose(out, ref, atol=3e-2, rtol=2e-2, err_msg=f"seed {seed}")  # bf16 output ulps
        assert not out[int(qsl[-1]):].any(), "padding token rows must be zero"


def test_decode_kernel_fp8_dots_stay_near_the_reference():
    """The fp8-MMA decode (q and P rounded to fp8 as well as K/V): a few percent of error, in every row."""
    case = DECODE_ONLY
    q, kv8, scales, qsl, seq_lens, block_tables = _fp8_batch(case, 0)
    config = dataclasses.replace(SPLIT_OFF, decode_fp8_dots="float8_e4m3fn")
    out = gpu.ragged_paged_attention(q, kv8, qsl, seq_lens, block_tables, sm_scale=case.head_dim ** -0.5,
                                     interpret=True, config=config, decode_only=True, kv_scale=scales)
    with jax.default_matmul_precision("highest"):
        ref = reference_attention(q, layout.to_reference_layout(kv8), qsl, seq_lens, block_tables,
                                  sm_scale=case.head_dim ** -0.5, kv_scale=scales)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    real = int(qsl[-1])
    err = np.abs(out[:real] - ref[:real]).mean(axis=(1, 2)) / np.abs(ref[:real]).mean(axis=(1, 2))
    assert (err < 0.1).all(), f"relative error per token row {err}"
    assert not out[real:].any(), "padding token rows must be zero"


def test_fp8_dot_dtype_is_validated():
    with pytest.raises(ValueError, match="decode_fp8_dots"):
        gpu.TuningConfig(decode_fp8_dots="bfloat8")


# ---------------------------------------------------------------- the model and the engine


def test_fp8_kv_agrees_with_model_dtype_kv_on_hf_fixtures(hf_fixture):
    """Teacher-forced over the fixture's first 12 greedy tokens (HF's, which the float32 cache reproduces;
    chunked prefill of 5 tokens, shuffled pages): the fp8 cache's logits stay close and its argmax agrees at
    >= 85% of the positions.

    The fixtures are random-weight models whose top-2 logit margins are small (median about 0.3, logits'
    std about 1.2), so fp8's 3 mantissa bits flip some near-ties: 89-94% agree here, and a trained model
    (the adder above) keeps every answer."""
    model = hf_fixture.model
    common = dict(block_size=4, chunk_size=5, shuffle_seed=1)
    greedy = [generated[:12] for generated in hf_fixture.generated]
    forced = [p + t[:-1] for p, t in zip(hf_fixture.prompts, greedy)]
    high = reference_generate.greedy_generate(model.params, model.config, forced, max_new_tokens=1, **common)
    low = reference_generate.greedy_generate(model.params, model.config, forced, max_new_tokens=1,
                                             kv_cache_dtype=fp8.DTYPE, **common)
    hits, errors, spread = [], [], []
    for prompt, tokens, hi, lo in zip(hf_fixture.prompts, greedy, high.logits, low.logits):
        rows = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        assert list(hi[rows].argmax(-1)) == tokens  # (the float32 cache's forced run gives HF's greedy tokens)
        hits += list(lo[rows].argmax(-1) == np.asarray(tokens))
        errors.append(lo[rows] - hi[rows])
        spread.append(hi[rows].std())
    agreement = float(np.mean(hits))
    rms_error = float(np.sqrt(np.mean(np.concatenate(errors) ** 2)))
    assert len(hits) == 12 * len(hf_fixture.prompts) and agreement >= 0.85, f"{hf_fixture.name}: {agreement:.3f}"
    assert rms_error <= 0.15 * float(np.mean(spread)), f"{hf_fixture.name}: logits off by {rms_error:.3f} rms"


def _adder_llm(**overrides) -> LLM:
    return LLM(config=load_config(TINY_CONFIG), progress=False, kv_cache_dtype="fp8", precompile=False, **overrides)


def _adder_accuracy(llm: LLM, count: int, seed: int) -> tuple[float, list[str]]:
    held_out = held_out_problems()
    cases = [held_out[i] for i in np.random.default_rng(seed).choice(len(held_out), count, replace=False)]
    outputs = llm.generate([f"{a}+{b}=" for a, b in cases], GREEDY, use_tqdm=False)
    answers = [o.outputs[0].text for o in outputs]
    return float(np.mean([t == str(a + b) for t, (a, b) in zip(answers, cases)])), answers


def test_adder_with_fp8_kv_under_preemption_and_prefix_caching():
    """The embedded adder over an fp8 cache: 300 problems at once in a pool of 12 blocks (recompute
    preemption), prefix caching on; >= 98% correct, every block returned."""
    llm = _adder_llm(num_blocks=12)
    assert llm.engine.runner.kv_caches[0].dtype == fp8.DTYPE
    accuracy, _ = _adder_accuracy(llm, 300, seed=7)
    assert accuracy >= 0.98, accuracy
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    again = llm.generate(["123+456=", "123+457="], GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in again] == ["579", "580"]
    assert llm.engine.kv_cache.stats.hits > 0
    assert llm.engine.kv_cache.usage == 0.0


def test_fp8_kv_chunked_prefill_and_swap_preemption_keep_the_tokens():
    """Chunked prefill (3-token budget: blocks filled over several steps) and swap preemption through the
    host tier (fp8 blocks move as raw bytes) give the tokens of a roomy fp8 engine."""
    _, want = _adder_accuracy(_adder_llm(), 24, seed=3)
    _, chunked = _adder_accuracy(_adder_llm(max_num_batched_tokens=3, token_buckets=[3]), 24, seed=3)
    assert chunked == want
    swap = _adder_llm(num_blocks=12, host_kv_gib=1 / 1024, preemption_mode="swap")
    _, swapped = _adder_accuracy(swap, 24, seed=3)
    assert swapped == want
    stats = swap.engine.kv_cache.stats
    assert swap.engine.scheduler.num_preemptions > 0 and stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out
    assert swap.engine.kv_transfer.tiers.host.dtype == fp8.DTYPE


def test_fp8_kv_fits_twice_the_blocks():
    """The memory accounting counts 1 byte per fp8 element: the same free memory holds twice the blocks."""
    cfg = llama_hf.config_from_hf(json.loads((TINY_MODEL / "config.json").read_text()), "bfloat16")
    counts = {}
    for name in ("auto", "fp8"):
        config = EngineConfig().with_overrides(kv_cache_dtype=name, gpu_memory_utilization=0.5)
        dtype = device_setup.kv_cache_dtype(config, cfg, "reference")
        with mock.patch.object(device_setup.jax, "default_backend", return_value="gpu"), \
                mock.patch.object(device_setup, "device_memory", return_value=(1 << 30, 1 << 28)):
            counts[name] = device_setup.kv_cache_num_blocks(cfg, config, 32, np.dtype(dtype).itemsize)
    assert counts["fp8"] == 2 * counts["auto"] > 0, counts


def test_checkpoint_kv_scales_are_read_and_checked(tmp_path):
    """k_scale / v_scale / kv_scale tensors (scalar or per kv head) become each layer's [2, K] scales; the
    loader skips them; a bad one is refused naming it."""
    import shutil

    from safetensors.numpy import save_file

    model_dir = tmp_path / "adder"
    shutil.copytree(TINY_MODEL, model_dir)
    cfg = loader.load_config(model_dir)[0]
    save_file({"model.layers.0.self_attn.k_scale": np.float32([0.5]),
               "model.layers.0.self_attn.v_scale": np.full(cfg.num_kv_heads, 0.25, np.float32),
               f"model.layers.{cfg.num_layers - 1}.self_attn.kv_scale": np.array(2.0, np.float32)},
              model_dir / "kv_scales.safetensors")
    scales = kv_scales.checkpoint_scales(model_dir, cfg.num_layers, cfg.num_kv_heads)
    want = np.ones((cfg.num_layers, 2, cfg.num_kv_heads), np.float32)
    want[0, 0], want[0, 1], want[-1] = 0.5, 0.25, 2.0
    np.testing.assert_array_equal(scales, want)
    llm = LLM(model=str(model_dir), kv_cache_dtype="fp8_e4m3", max_model_len=32, block_size=4, num_blocks=64,
              progress=False, precompile=False)
    np.testing.assert_array_equal(np.asarray(llm.engine.runner.model.params["layers"][0]["kv_scale"]), want[0])
    assert llm.generate(["12+34="], GREEDY, use_tqdm=False)[0].outputs[0].text == "46"
    save_file({"model.layers.0.self_attn.k_scale": np.float32([0.0])}, model_dir / "kv_scales.safetensors")
    with pytest.raises(loader.CheckpointError, match="k_scale .* must hold one positive finite scale"):
        kv_scales.checkpoint_scales(model_dir, cfg.num_layers, cfg.num_kv_heads)


def test_unsupported_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not supported; choose one of"):
        LLM(kv_cache_dtype="fp8_e5m2", progress=False)
    config = EngineConfig().with_overrides(kv_cache_dtype="fp8")
    cfg = llama_hf.config_from_hf(json.loads((TINY_MODEL / "config.json").read_text()), "bfloat16")
    with mock.patch.object(device_setup.jax, "default_backend", return_value="tpu"):
        with pytest.raises(ValueError, match="not supported yet by the TPU attention kernel"):
            device_setup.kv_cache_dtype(config, cfg, "pallas")
