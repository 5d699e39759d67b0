"""Write the FP8 checkpoint fixtures of tests/fixtures/fp8 from the float32 HF fixtures (tests/fixtures/hf).

    llama3_ct_fp8_channel   compressed-tensors: float8_e4m3fn `weight` + per-channel `weight_scale` [out, 1],
                            dynamic per-token input activations (the FP8-dynamic scheme), ignore [lm_head];
                            from llama3_gqa4_tied
    llama2_fp8_block        quant_method fp8 with weight_block_size [32, 48] (ragged: 64 and 128 are not
                            multiples of 48), `weight_scale_inv` [ceil(out / 32), ceil(in / 48)],
                            activation_scheme dynamic; from llama2_mha_untied

Every linear weight of the decoder (q/k/v/o, gate/up/down) is quantized as the formats define it: scale =
amax of its channel or block / 448, fp8 = round(weight / scale), weight ~= fp8 * scale. Embeddings, norms and
lm_head are copied as they are. numpy only: the safetensors file is written here byte by byte, because the
safetensors numpy writer has no float8.

    python scripts/make_fp8_fixtures.py   (from the repository root)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "fixtures" / "hf"
OUT = ROOT / "tests" / "fixtures" / "fp8"
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def save(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file: 8-byte header length, JSON header (sorted names, data offsets), the raw data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name]).tobytes()
        header[name] = {"dtype": DTYPE_NAMES[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def to_fp8(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = (np.abs(w).max(axis=1, keepdims=True) / FP8_MAX).astype(np.float32)  # [out, 1]
    return to_fp8(w, scale), scale


def per_block(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    (out_dim, in_dim), (bo, bi) = w.shape, block
    scale = np.zeros((-(-out_dim // bo), -(-in_dim // bi)), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = np.abs(w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]).max() / FP8_MAX
    full = np.repeat(np.repeat(scale, bo, axis=0)[:out_dim], bi, axis=1)[:, :in_dim]
    return to_fp8(w, full), scale


def convert(source: str, name: str, quantization_config: dict, quantize, scale_name: str) -> None:
    src, dst = SOURCE / source, OUT / name
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        for key in f.keys():
            w = f.get_tensor(key)
            if key.endswith(".weight") and key.split(".")[-2] in LINEARS:
                q, scale = quantize(w)
                tensors[key], tensors[key.removesuffix("weight") + scale_name] = q, scale
            else:
                tensors[key] = w
    save(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")


def main() -> int:
    fp8_args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    convert("llama3_gqa4_tied", "llama3_ct_fp8_channel", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {**fp8_args, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**fp8_args, "strategy": "token", "dynamic": True, "observer": None}}},
    }, per_channel, "weight_scale")
    block = (32, 48)
    convert("llama2_mha_untied", "llama2_fp8_block", {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }, lambda w: per_block(w, block), "weight_scale_inv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
