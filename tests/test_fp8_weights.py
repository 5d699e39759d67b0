"""FP8 weights (models/quant.py): pre-quantized checkpoints (compressed-tensors per channel, block-wise fp8)
against a dequantized reference computed here from the safetensors bytes; online quantization against the
float path; the embedded adder's accuracy; tensor parallelism; weights held [N, K] (a single-device Hopper
engine's layout) against the weights' own; and every refusal naming its field."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.models import llama, loader, quant
from jaxserve.models.family import UnsupportedModelError
from jaxserve.runner import device_setup
from pallas_kernels.fp8_gemm import mosaic_gpu
from sharding import TensorParallel, make_mesh
from jaxserve.tokenizer import Tokenizer
from scripts.make_fp8_fixtures import save as save_raw
from tests import reference_generate
from tests.conftest import HF_FIXTURES, HF_MOE_NAMES, ROOT, TINY_MODEL
from tools import train_tiny

FP8 = ROOT / "tests" / "fixtures" / "fp8"
CT, BLOCK = FP8 / "llama3_ct_fp8_channel", FP8 / "llama2_fp8_block"
# One fixture per attention variant: GQA with llama3 rope, sliding window, per-head q/k norm.
AGREEMENT_NAMES = ["llama3_gqa4_tied", "mistral_gqa4_untied", "qwen3_gqa1_untied"]


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, parsed from its bytes (float8 included)."""
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32}
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    return {name: np.frombuffer(raw[8 + size + info["data_offsets"][0]: 8 + size + info["data_offsets"][1]],
                                dtypes[info["dtype"]]).reshape(info["shape"]) for name, info in header.items()}


def dequantized_checkpoint(src, dst):
    """The float32 checkpoint an FP8 checkpoint stands for: weight = fp8 * scale, broadcast per tensor or
    channel, or repeated over each [bo, bi] block."""
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    tensors = read_safetensors(src / "model.safetensors")
    out = {}
    for name, array in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if array.dtype != ml_dtypes.float8_e4m3fn:
            out[name] = array
            continue
        w = array.astype(np.float32)
        if qc.get("weight_block_size"):
            bo, bi = qc["weight_block_size"]
            s = tensors[name.removesuffix("weight") + "weight_scale_inv"]
            s = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
        else:
            s = tensors[name.removesuffix("weight") + "weight_scale"].reshape(-1, 1)
        out[name] = w * s
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("src", [CT, BLOCK], ids=["compressed_tensors_channel", "fp8_block"])
def test_fp8_checkpoint_matches_dequantized_reference(src, tmp_path):
    model = loader.load_model(src, dtype="float32")
    assert model.config.quantization is not None
    wq = model.params["layers"][0]["wq"]
    assert isinstance(wq, quant.Fp8Weight) and wq.q.dtype == jax.numpy.float8_e4m3fn
    assert not isinstance(model.params["embed"], quant.Fp8Weight)
    reference = loader.load_model(dequantized_checkpoint(src, tmp_path / "ref"), dtype="float32")
    ids = np.array([[3, 5, 7, 9, 11, 13, 2, 4, 100, 200, 17, 40]])
    got = np.asarray(llama.forward_dense(model.params, model.config, ids))
    want = np.asarray(llama.forward_dense(reference.params, reference.config, ids))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_per_tensor_scale_is_held_per_channel(tmp_path):
    """compressed-tensors strategy tensor: one scale [1] per weight."""
    dst = tmp_path / "tensor"
    shutil.copytree(CT, dst)
    tensors = read_safetensors(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith("weight_scale")]:
        w = tensors[name.removesuffix("weight_scale") + "weight"].astype(np.float32) * tensors[name]
        scale = np.abs(w).max() / 448.0
        tensors[name.removesuffix("weight_scale") + "weight"] = (w / scale).astype(ml_dtypes.float8_e4m3fn)
        tensors[name] = np.array([scale], np.float32)
    save_raw(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (dst / "config.json").write_text(json.dumps(config))
    model = loader.load_model(dst, dtype="float32")
    assert model.params["layers"][1]["w_down"].scale.shape == (1, 64)
    reference = loader.load_model(dequantized_checkpoint(dst, tmp_path / "ref"), dtype="float32")
    ids = np.array([[1, 2, 3, 4, 5, 6]])
    np.testing.assert_allclose(np.asarray(llama.forward_dense(model.params, model.config, ids)),
                               np.asarray(llama.forward_dense(reference.params, reference.config, ids)),
                               atol=2e-5, rtol=1e-5)


def test_online_fp8_agrees_with_bfloat16_on_greedy_tokens():
    """Teacher-forced over the fixtures' reference sequences: the argmax at every position. These are
    random-weight models whose top-2 logits are often close (median gap ~0.3, FP8's logit noise ~0.1), so
    all positions agree less than a trained model's would; where bfloat16 is clear (gap > 0.5) they agree."""
    agree = total = clear_agree = clear_total = 0
    forward = jax.jit(llama.forward_dense, static_argnums=1)
    for name in AGREEMENT_NAMES:
        path = HF_FIXTURES / name
        ref = json.loads((path / "reference.json").read_text())
        bf16 = loader.load_model(path, dtype="bfloat16")
        fp8 = loader.load_model(path, dtype="bfloat16", quantization="fp8")
        assert fp8.config.quantization == quant.QuantSpec("online")
        sequences = [prompt + generated for prompt, generated in zip(ref["prompts"], ref["generated"])]
        width = max(map(len, sequences))  # causal: the padding after a sequence changes none of its rows
        ids = np.array([seq + [0] * (width - len(seq)) for seq in sequences])
        want_all = np.asarray(forward(bf16.params, bf16.config, ids), np.float32)
        got_all = np.asarray(forward(fp8.params, fp8.config, ids), np.float32).argmax(-1)
        for i, seq in enumerate(sequences):
            want, got = want_all[i, : len(seq)], got_all[i, : len(seq)]
            top2 = np.sort(want, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 0.5
            same = got == want.argmax(-1)
            agree, total = agree + same.sum(), total + same.size
            clear_agree, clear_total = clear_agree + same[clear].sum(), clear_total + clear.sum()
    assert agree / total >= 0.85, f"{agree}/{total}"
    assert clear_agree / clear_total >= 0.98, f"{clear_agree}/{clear_total}"


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_embedded_adder_with_fp8_weights(w8a8, monkeypatch, request):
    """FP8 weights dequantized (off a GPU), and every matmul as W8A8 (the GPU's prefill path: rows quantized
    to fp8 per token)."""
    if w8a8:  # (traced anew: the programs jitted without the patch are dropped before and after)
        calls = []
        monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows, _w: calls.append(num_rows) or True)
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
    model = loader.load_model(TINY_MODEL, quantization="fp8")
    tokenizer = Tokenizer.from_dir(TINY_MODEL)
    held_out = train_tiny.held_out_problems()
    rng = np.random.default_rng(2026)
    problems = [held_out[i] for i in rng.choice(len(held_out), 300, replace=False)]
    prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in problems]
    result = reference_generate.greedy_generate(model.params, model.config, prompts, max_new_tokens=6, block_size=4,
                                                eos_token_ids=model.generation.eos_token_ids, keep_logits=False)
    correct = [tokenizer.decode(tokens) == str(a + b) and tokens[-1] == tokenizer.eos_token_id
               for tokens, (a, b) in zip(result.tokens, problems)]
    assert np.mean(correct) >= 0.98, np.mean(correct)
    assert not w8a8 or calls  # the W8A8 path ran


def _llm(path, tp: int, **options) -> LLM:
    return LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4,
               num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4, token_buckets=[32], request_buckets=[4],
               precompile=False, progress=False, tensor_parallel_size=tp, **options)


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [[3, 5, 7, 9, 11], [100, 90, 80, 70, 60, 50, 40, 30, 20], [1, 2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def _generate(path, tp: int, **options) -> list[list[int]]:
    return _greedy(_llm(path, tp, **options))


@pytest.mark.parametrize("path,options", [(HF_FIXTURES / "llama3_gqa4_tied", {"quantization": "fp8"}), (BLOCK, {})],
                         ids=["online", "block"])
def test_tensor_parallel_fp8_gives_the_same_tokens(path, options):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    assert _generate(path, 2, **options) == _generate(path, 1, **options)


def test_weights_held_transposed_give_the_same_tokens(monkeypatch, request):
    """An engine whose per-channel FP8 weights are held [N, K] (what device_setup.holds_fp8_transposed picks
    on one Hopper GPU, forced here), a layer's weights over one input joined, generates the tokens of one
    holding them in their own layout, every matmul as W8A8 (a GPU's path besides the decode kernel:
    tests/test_fp8_gemm.py runs that one). Block-scaled weights keep their layout."""
    monkeypatch.setattr(quant, "tensor_cores_apply", lambda num_rows, w: True)
    jax.clear_caches()  # (traced anew: the programs jitted without the patch are dropped before and after)
    request.addfinalizer(jax.clear_caches)
    path = HF_FIXTURES / "llama3_gqa4_tied"
    want = _generate(path, 1, quantization="fp8")
    monkeypatch.setattr(device_setup, "holds_fp8_transposed", lambda cfg, tp: True)
    llm = _llm(path, 1, quantization="fp8")
    layer = llm.engine.runner.model.params["layers"][0]
    joined = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
    assert all(layer[name].transposed for name in joined) and not any(n in layer for p in joined.values() for n in p)
    assert all(layer[name].transposed for name in llama.QUANTIZED if name in layer)
    assert layer["wo"].q.shape == (layer["wo"].shape[2], layer["wo"].shape[0] * layer["wo"].shape[1])
    assert _greedy(llm) == want
    block = loader.load_model(BLOCK, dtype="float32").params["layers"][0]["wq"]
    assert not device_setup.hold_fp8_transposed({"wq": block})["wq"].transposed


def test_which_engines_hold_fp8_weights_transposed(monkeypatch):
    """One Hopper GPU (a data-parallel replica's one-device mesh too) with a bfloat16 model's FP8 weights;
    not tensor parallelism, other devices, other model dtypes or float weights."""
    gpu = SimpleNamespace(platform="gpu", compute_capability="9.0")
    assert mosaic_gpu.runs_on(gpu) and not mosaic_gpu.runs_on(jax.devices()[0])
    assert not any(mosaic_gpu.runs_on(SimpleNamespace(platform="gpu", compute_capability=cc)) for cc in ("8.9", "10.0"))
    cfg, _ = loader.load_config(HF_FIXTURES / "llama3_gqa4_tied", "bfloat16", "fp8")
    assert not device_setup.holds_fp8_transposed(cfg, None)  # a CPU
    monkeypatch.setattr(mosaic_gpu, "runs_on", lambda device: True)
    assert device_setup.holds_fp8_transposed(cfg, None)
    assert device_setup.holds_fp8_transposed(cfg, TensorParallel(make_mesh(1, 1)))
    if len(jax.devices()) > 1:
        assert not device_setup.holds_fp8_transposed(cfg, TensorParallel(make_mesh(1, 2)))
    assert not device_setup.holds_fp8_transposed(dataclasses.replace(cfg, dtype="float32"), None)
    assert not device_setup.holds_fp8_transposed(dataclasses.replace(cfg, quantization=None), None)


def _edit_ct(tmp_path, **changes):
    dst = tmp_path / "ckpt"
    shutil.copytree(CT, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():  # "a__b__c": quantization_config["a"]["b"]["c"]
        *parents, last = key.split("__")
        node = config["quantization_config"]
        for part in parents:
            node = node[part]
        node[last] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


GROUP = "config_groups__group_0__"


@pytest.mark.parametrize("changes,match", [
    ({"quant_method": "awq"}, r"quantization_config.quant_method='awq' is not supported"),
    ({"format": "pack-quantized"}, r"quantization_config.format='pack-quantized'"),
    ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, r"quantization_config.ignore=\['model.layers.0.mlp"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"quantization_config.kv_cache_scheme="),
    ({GROUP + "weights__strategy": "group"}, r"config_groups.group_0.weights.strategy='group'"),
    ({GROUP + "weights__num_bits": 4}, r"config_groups.group_0.weights=\{'type': 'float', 'num_bits': 4\}"),
    ({GROUP + "input_activations__type": "int"}, r"config_groups.group_0.input_activations="),
    ({GROUP + "output_activations": {"num_bits": 8}}, r"config_groups.group_0.output_activations="),
    ({GROUP + "targets": ["Attention"]}, r"config_groups.group_0.targets=\['Attention'\]"),
])
def test_unsupported_compressed_tensors_configs_are_refused(tmp_path, changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        loader.load_model(_edit_ct(tmp_path, **changes), dtype="float32")


@pytest.mark.parametrize("changes,match", [
    ({"fmt": "e5m2"}, r"quantization_config.fmt='e5m2'"),
    ({"activation_scheme": "per_block"}, r"quantization_config.activation_scheme='per_block'"),
    ({"weight_block_size": [128]}, r"quantization_config.weight_block_size=\[128\]"),
    ({"ignored_layers": ["model.layers.1.self_attn.q_proj"]}, r"quantization_config.ignored_layers="),
])
def test_unsupported_fp8_configs_are_refused(tmp_path, changes, match):
    dst = tmp_path / "ckpt"
    shutil.copytree(BLOCK, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=match):
        loader.load_model(dst, dtype="float32")


def test_checkpoint_errors_name_the_tensor(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(CT, dst)
    tensors = read_safetensors(dst / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].astype(np.float32)
    save_raw(tensors, dst / "model.safetensors")
    with pytest.raises(loader.CheckpointError, match=rf"{name} in model.safetensors has dtype F32.*F8_E4M3"):
        loader.load_model(dst)
    save_raw({n: t for n, t in tensors.items() if not n.endswith("weight_scale")}, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(loader.CheckpointError, match="float8 .* no quantization_config"):
        loader.load_model(dst)


def test_unsupported_quantization_requests_are_refused():
    with pytest.raises(UnsupportedModelError, match="not supported for mixture-of-experts models"):
        loader.load_model(HF_FIXTURES / HF_MOE_NAMES[0], quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        loader.load_model(CT, quantization="int8")
    with pytest.raises(ValueError, match=r"model.quantization='awq' is not supported; use fp8"):
        LLM(model=str(CT), quantization="awq")
