"""Causal GQA flash attention for long fresh prefills (no cached prefix).

    flash_attention(q [B, T, N, H], k/v [B, T, K, H], *, causal, sm_scale, seq_lens [B], config)
        -> [B, T, N, H]

`flash_attention` dispatches: on a Hopper GPU (compute capability 9.x), calls inside
`mosaic_gpu.supports` (causal, no seq_lens, bf16/f16, H % 64 == 0, even G) run the Mosaic GPU
kernel (`mosaic_gpu.py`: TMA + wgmma, warp-specialised; faster than the Triton kernel and level
with cuDNN on Hopper, benchmarks/RESULTS.md); everything else runs the Pallas Triton kernel
(`triton.py`: online softmax over block_q x block_k tiles, causal tile skipping, GQA through the
index_map). A config picks its kernel: `FlashAttentionConfig` is Triton's, `MosaicAttentionConfig`
Mosaic's. `reference.py` is the pure-jnp ground truth both are tested against. Rows at or past
`seq_lens[b]` are zeros.
"""

from __future__ import annotations

import jax

from pallas_kernels.flash_attention import mosaic_gpu, triton
from pallas_kernels.flash_attention.mosaic_gpu import MosaicAttentionConfig
from pallas_kernels.flash_attention.reference import flash_attention_reference
from pallas_kernels.flash_attention.triton import FlashAttentionConfig, default_config

__all__ = ["FlashAttentionConfig", "MosaicAttentionConfig", "default_config", "flash_attention",
           "flash_attention_reference", "on_hopper"]


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: wgmma and TMA for the Mosaic kernel)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, seq_lens=None,
                    config: FlashAttentionConfig | MosaicAttentionConfig | None = None,
                    interpret: bool = False):
    """Attention of fresh prompts over themselves; q head n reads kv head n // (N // K)."""
    use_mosaic = isinstance(config, MosaicAttentionConfig) or (
        config is None and not interpret and on_hopper()
        and mosaic_gpu.supports(q, k, causal=causal, seq_lens=seq_lens))
    kernel = mosaic_gpu.flash_attention if use_mosaic else triton.flash_attention
    return kernel(q, k, v, causal=causal, sm_scale=sm_scale, seq_lens=seq_lens, config=config,
                  interpret=interpret)
