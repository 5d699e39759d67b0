"""Swap or recompute: what a preempted request's KV costs to keep (host-only; no JAX).

    recompute: its blocks are freed; on resuming, its tokens are computed again (prefill), except the
               leading blocks that another running request holds (they stay cached on the device)
    swap:      its blocks are copied device -> host now and host -> device on resuming (kv_tiers/link.py)

    swap costs  2 x blocks x bytes per block / COPY_BYTES_PER_S
    recompute   tokens to compute again / PREFILL_TOKENS_PER_S

The rates are the constants below (an engine may be given others: Scheduler(preemption_cost=...)).
Their ratio is what decides: swap wins while a token's KV bytes move (both ways) faster than the token
computes.
"""

from __future__ import annotations

import dataclasses

# Device <-> host KV copy bandwidth, bytes/s, one direction: a PCIe Gen4/Gen5 x16 copy from pinned memory
# sustains ~20-50 GB/s; the lower end, as copies share the link with the step's own traffic.
COPY_BYTES_PER_S = 20e9
# Prefill throughput, tokens/s: an 8B model (~16 GFLOP a token) on one H100/H200-class GPU at half of its
# ~1 PFLOP/s bf16 peak computes ~30k tokens/s; smaller models more, longer contexts fewer.
PREFILL_TOKENS_PER_S = 20e3


@dataclasses.dataclass
class PreemptionCost:
    copy_bytes_per_s: float = COPY_BYTES_PER_S
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S

    def swap_seconds(self, num_blocks: int, block_bytes: int) -> float:
        return 2 * num_blocks * block_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefer_swap(self, num_blocks: int, block_bytes: int, num_recompute_tokens: int) -> bool:
        return self.swap_seconds(num_blocks, block_bytes) < self.recompute_seconds(num_recompute_tokens)
