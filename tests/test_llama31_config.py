"""configs/models/llama3.1-8b: Llama-3.1-8B's HF config (llama3 rope scaling, 131072 positions) and its
dummy-weight bench config. The llama3 rope path is checked against transformers' logits by the
llama3_gqa4_tied fixture (test_model_parity); here the frequencies at Llama-3.1's own parameters
(theta 500000, head_dim 128, original context 8192) are checked band by band against Meta's formula
evaluated in float64."""

from __future__ import annotations

import json
import math

import numpy as np

from jaxserve.config import load_config
from jaxserve.models import layers, loader
from tests.conftest import ROOT

MODEL = ROOT / "configs" / "models" / "llama3.1-8b"


def _meta_llama3_inv_freq(head_dim, theta, factor, low, high, original) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.asarray(out)


def test_llama31_config_loads_with_llama3_rope_and_128k_positions():
    cfg, hf = loader.load_config(MODEL)
    assert cfg.max_position_embeddings == 131072 and cfg.head_dim == 128
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (32, 32, 8, 128256)
    scaling = dict(cfg.rope_scaling)
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    got = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    want = _meta_llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    wavelen = 2 * math.pi / want
    assert (wavelen < 8192 / 4).any() and (wavelen > 8192).any() and ((wavelen >= 2048) & (wavelen <= 8192)).any()
    bench = load_config(ROOT / "configs" / "llama3.1-8b-dummy.yaml")
    assert bench.model.max_model_len == 131072 and bench.model.load_format == "dummy"
    assert json.loads((MODEL / "config.json").read_text())["rope_scaling"]["original_max_position_embeddings"] == 8192
