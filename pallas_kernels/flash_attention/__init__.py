"""Causal GQA flash attention for long fresh prefills (no cached prefix).

    flash_attention(q [B, T, N, H], k/v [B, T, K, H], *, causal, sm_scale, seq_lens [B], config)
        -> [B, T, N, H]

`triton.py` holds the Pallas Triton kernel (online softmax over block_q x block_k tiles, causal tile
skipping, GQA through the index_map, tuning knobs in the frozen `FlashAttentionConfig`);
`reference.py` the pure-jnp ground truth it is tested against. Rows at or past `seq_lens[b]` are zeros.
"""

from pallas_kernels.flash_attention.reference import flash_attention_reference
from pallas_kernels.flash_attention.triton import FlashAttentionConfig, default_config, flash_attention

__all__ = ["FlashAttentionConfig", "default_config", "flash_attention", "flash_attention_reference"]
