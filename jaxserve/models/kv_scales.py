"""The static K/V scales of an fp8 KV cache (cache.kv_cache_dtype: fp8): one per layer, K or V and kv head.

    checkpoint tensors (vLLM's names; scalar, [1] or [K], float):
        model.layers.{i}.self_attn.k_scale, .v_scale     (or one .kv_scale for both)
    --read on the host, broadcast to [2, K], checked positive and finite--> params["layers"][i]["kv_scale"]
    no such tensors: every scale is 1

A stored fp8 value q means q * scale (pallas_kernels/paged_attention/fp8.py says why the scales are static).
The scales are a parameter of each layer (logical axes (None, "kv_heads"), models/llama.py AXES), so tensor
parallelism places them with their kv heads and the step passes them to the attention with the layer's
weights. The loader skips these tensors (loader.IGNORED_SUFFIXES); only an fp8 cache reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from safetensors import safe_open

SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale")


def checkpoint_scales(model_dir: str | Path, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """[L, 2, K] float32: the checkpoint's K/V scales, 1 where it names none."""
    from jaxserve.models.loader import CheckpointError, weight_files

    scales = np.ones((num_layers, 2, num_kv_heads), np.float32)
    files = weight_files(Path(model_dir))
    for i in range(num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for kv, names in enumerate(((prefix + "k_scale", prefix + "kv_scale"), (prefix + "v_scale", prefix + "kv_scale"))):
            name = next((n for n in names if n in files), None)
            if name is None:
                continue
            with safe_open(files[name], framework="numpy") as f:
                value = np.asarray(f.get_tensor(name), np.float32).reshape(-1)
            if value.size not in (1, num_kv_heads) or not (np.isfinite(value).all() and (value > 0).all()):
                raise CheckpointError(f"tensor {name} in {files[name].name} must hold one positive finite scale "
                                      f"or one per kv head ({num_kv_heads}); it holds {value.tolist()[:8]}")
            scales[i, kv] = value
    return scales


def with_kv_scales(params: dict[str, Any], cfg: Any, scales: np.ndarray,
                   place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> dict[str, Any]:
    """params with each layer's "kv_scale" [2, K] (scales [L, 2, K]) placed by `place(path, array)`
    (the family's param_placer; default: the default device)."""
    place = place or (lambda _path, array: jax.device_put(array))
    layer_params = [dict(lp, kv_scale=place(("layers", i, "kv_scale"), scales[i]))
                    for i, lp in enumerate(params["layers"])]
    return dict(params, layers=layer_params)


def load(model_dir: str | Path, params: dict[str, Any], cfg: Any, load_format: str = "auto",
         place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> dict[str, Any]:
    """params with the K/V scales of the checkpoint in `model_dir` (all 1 for dummy weights)."""
    if load_format == "dummy":
        scales = np.ones((cfg.num_layers, 2, cfg.num_kv_heads), np.float32)
    else:
        scales = checkpoint_scales(model_dir, cfg.num_layers, cfg.num_kv_heads)
    return with_kv_scales(params, cfg, scales, place)
