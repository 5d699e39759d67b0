"""Causal GQA flash attention for long prompts: a fresh prompt, or one chunk of it over the K/V of
the chunks before it.

    flash_attention(q [B, Tq, N, H], k/v [B, Tkv, K, H], *, causal, sm_scale, seq_lens [B],
                    q_offset [B], config) -> [B, Tq, N, H]

Query row i of sequence b sits at absolute position q_offset[b] + i (traced; None: 0, and then
Tq == Tkv) and attends to keys 0..that position below seq_lens[b] (None: Tkv); rows at positions at or
past seq_lens[b] are zeros. K/V may be longer than q_offset + Tq (a static bucket): keys past a row's
causal limit are never read. `reference.py` is the pure-jnp ground truth both kernels are tested
against.

`flash_attention` dispatches: on a Hopper GPU (compute capability 9.x), calls inside
`mosaic_gpu.supports` (causal, no seq_lens, bf16/f16, H % 64 == 0, even G) run the Mosaic GPU
kernel (`mosaic_gpu.py`: TMA + wgmma, warp-specialised; faster than the Triton kernel and level
with cuDNN on Hopper, benchmarks/RESULTS.md); everything else runs the Pallas Triton kernel
(`triton.py`: online softmax over block_q x block_k tiles, causal tile skipping, GQA through the
index_map). A config picks its kernel: `FlashAttentionConfig` is Triton's, `MosaicAttentionConfig`
Mosaic's.

The engine calls it for the long request of a prefill step (jaxserve/models/layers.py,
`paged_attention`): that request's K/V gathered from the paged cache into [1, Tkv, K, H] (zeros past
its length), its rows of the step as q, q_offset its tokens cached before the step.
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
                    q_offset=None, config: FlashAttentionConfig | MosaicAttentionConfig | None = None,
                    interpret: bool = False):
    """Causal attention of q (row i at position q_offset + i) over k/v; q head n reads kv head n // (N // K)."""
    use_mosaic = isinstance(config, MosaicAttentionConfig) or (
        config is None and not interpret and on_hopper()
        and mosaic_gpu.supports(q, k, causal=causal, seq_lens=seq_lens))
    kernel = mosaic_gpu.flash_attention if use_mosaic else triton.flash_attention
    return kernel(q, k, v, causal=causal, sm_scale=sm_scale, seq_lens=seq_lens, q_offset=q_offset,
                  config=config, interpret=interpret)
