"""HF checkpoint loading: sharded files, generation config, orbax round trip, and every bad input
of the loader: each must raise an error naming the file or tensor at fault."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.models import checkpoint, loader, registry
from jaxserve.models.loader import CheckpointError
from jaxserve.models.registry import UnsupportedModelError
from tests.conftest import HF_FIXTURES

SRC = HF_FIXTURES / "qwen2_gqa4_tied"


@pytest.fixture
def ckpt(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(SRC, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def assert_params_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sharded_checkpoint_with_index_loads_identically(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, ckpt / fname)
    (ckpt / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_params_equal(loader.load_model(ckpt, "float32").params, loader.load_model(SRC, "float32").params)


def test_index_naming_a_missing_file(ckpt):
    names = list(load_file(ckpt / "model.safetensors"))
    index = {"weight_map": {n: "model-00009.safetensors" for n in names}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00009.safetensors"):
        loader.load_model(ckpt)


def test_generation_defaults():
    m = loader.load_model(SRC, "float32")
    assert m.generation.eos_token_ids == (1,)
    assert m.generation.bos_token_id == 0


def test_generation_config_sampling_fields(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    gen = loader.load_model(ckpt).generation
    assert gen.eos_token_ids == (1, 7)
    assert gen.sampling == {"temperature": 0.6, "top_p": 0.9}


def test_dtype_auto_uses_config_dtype_and_explicit_overrides():
    assert loader.load_config(SRC)[0].dtype == "float32"  # the fixture's config says float32
    assert loader.load_config(SRC, "bfloat16")[0].dtype == "bfloat16"
    with pytest.raises(UnsupportedModelError, match="int8"):
        loader.load_config(SRC, "int8")


def test_orbax_round_trip(tmp_path):
    m = loader.load_model(SRC, "bfloat16")
    checkpoint.save_params(m.params, tmp_path / "orbax")
    restored = checkpoint.restore_params(m.config, tmp_path / "orbax")
    assert_params_equal(m.params, restored)
    assert all(x.dtype == y.dtype for x, y in zip(jax.tree.leaves(m.params), jax.tree.leaves(restored)))


def test_save_safetensors_round_trip(tmp_path):
    m = loader.load_model(SRC, "float32")
    shutil.copy(SRC / "config.json", tmp_path / "config.json")
    loader.save_safetensors(m.params, m.config, tmp_path / "model.safetensors")
    original = load_file(SRC / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(original) == sorted(written)
    for name in original:
        np.testing.assert_array_equal(original[name], written[name])


def test_hub_style_rope_config_keys():
    """Hub checkpoints spell rope as rope_theta + rope_scaling; transformers 5 as rope_parameters."""
    hf = json.loads((HF_FIXTURES / "llama3_gqa4_tied" / "config.json").read_text())
    new_style = registry.config_from_hf(hf)
    old = dict(hf)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params
    assert registry.config_from_hf(old) == new_style
    assert new_style.rope_scaling is not None


# ---- bad input: a clear error naming what is wrong, never a bare KeyError or a partial load ----

def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        loader.load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        loader.load_model(tmp_path)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        loader.load_model(ckpt)


def test_unsupported_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        loader.load_model(ckpt)


def test_auto_map_code_is_never_imported(ckpt, tmp_path):
    marker = tmp_path / "imported"
    (ckpt / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    edit_config(ckpt, architectures=["EvilForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    with pytest.raises(UnsupportedModelError, match="never imports"):
        loader.load_model(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("changes,match", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type 'yarn'"),
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_unsupported_field_values(ckpt, changes, match):
    edit_config(ckpt, **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        loader.load_model(ckpt)


def test_missing_required_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        loader.load_model(ckpt)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.1\.self_attn\.k_proj\.bias"):
        loader.load_model(ckpt)


def test_extra_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.5.mlp.up_proj.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors model\.layers\.5\.mlp\.up_proj\.weight \(in model.safetensors\)"):
        loader.load_model(ckpt)


def test_misshaped_tensor(ckpt):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :-1].copy()
    edit_tensors(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"down_proj\.weight in model\.safetensors has shape \[64, 127\], expected \[64, 128\]"):
        loader.load_model(ckpt)


def test_pickle_weights_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*Convert them to safetensors"):
        loader.load_model(ckpt)


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        loader.load_model(ckpt)


def test_pickle_beside_safetensors_is_ignored(ckpt):
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04garbage")
    assert loader.load_model(ckpt, "float32").config.architecture == "Qwen2ForCausalLM"


def test_qwen3_attention_bias_covers_o_proj(tmp_path):
    """transformers' Qwen3Attention gives q/k/v and o_proj a bias when attention_bias is set."""
    path = tmp_path / "qwen3"
    shutil.copytree(HF_FIXTURES / "qwen3_gqa4_tied", path)
    edit_config(path, attention_bias=True)
    cfg = loader.load_config(path)[0]
    assert cfg.qkv_bias and cfg.o_bias
    with pytest.raises(CheckpointError, match=r"missing tensors .*model\.layers\.0\.self_attn\.o_proj\.bias"):
        loader.load_model(path)
    rng = np.random.default_rng(0)
    out = {proj: cfg.hidden_size if proj == "o" else (cfg.num_heads if proj == "q" else cfg.num_kv_heads) * cfg.head_dim
           for proj in "qkvo"}
    biases = {f"model.layers.{i}.self_attn.{proj}_proj.bias": rng.normal(size=size).astype(np.float32)
              for i in range(cfg.num_layers) for proj, size in out.items()}
    edit_tensors(path, lambda t: t.update(biases))
    params = loader.load_model(path, "float32").params
    for i in range(cfg.num_layers):
        np.testing.assert_array_equal(np.asarray(params["layers"][i]["bo"]),
                                      biases[f"model.layers.{i}.self_attn.o_proj.bias"])
    assert registry.to_hf_config(cfg)["attention_bias"] is True
