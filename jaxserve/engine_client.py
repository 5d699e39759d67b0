"""The engine as its users see it: what the server, LLM and the benchmarks call (host-only; no JAX).

    prepare_request(prompt, params, ...) -> PreparedRequest    validate + tokenize; queues nothing
    enqueue(prepared) / add_request(prompt, params, ...)       queue it (n > 1: n child sequences)
    abort_request(ids)                                         finish them with "abort", free their blocks
    step(final_only=False) -> [RequestOutput]                  one engine step; outputs of changed requests
    has_unfinished_requests()
    stats() -> EngineStats                                     the gauges and counters of /metrics
    close()                                                    shut down (KV disk tier: cached blocks written)
    tokenizer, max_model_len, vocab_size, sampling_defaults    read-only facts about the served model

`Engine` (jaxserve/engine.py) and `DataParallelEngine` (jaxserve/data_parallel.py) implement it; a
prefill/decode-disaggregated engine would too. One thread drives an engine client: every call above
except prepare_request (which only reads) comes from that thread.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Protocol, runtime_checkable

from jaxserve.core.kv_cache_manager import KVCacheStats
from jaxserve.input_processor import PreparedRequest, PromptType
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

__all__ = ["EngineClient", "EngineStats", "PreparedRequest", "PromptType"]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load. Counters are totals since the engine started."""

    num_running: int = 0  # requests being computed (prefill or decode)
    num_waiting: int = 0  # requests waiting to be scheduled (preempted ones included)
    kv_cache_usage: float = 0.0  # share of KV-cache blocks in use, 0..1 (data parallel: the replicas' mean)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens found there
    num_preemptions: int = 0  # requests preempted because KV blocks ran out
    # Expert parallelism (empty without): tokens routed to each logical expert, [MoE layer][expert], since
    # the last rebalance (up to the last processed step); and per MoE layer, the busiest expert device's
    # share of that load over the mean device's (1.0 = balanced; replicas split their expert's load evenly).
    expert_load: tuple[tuple[int, ...], ...] = ()
    expert_device_load_max_over_mean: tuple[float, ...] = ()
    # Speculative decoding: guesses scored, and of those accepted (their ratio is the acceptance rate).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0  # steps of a request with guesses
    spec_accepted_per_position: tuple[int, ...] = ()  # [j]: drafts whose guess j was accepted
    # The KV cache's counters (prefix-cache lookups, device evictions; per tier below the device: hits,
    # misses, bytes in and out, evictions, loads and their seconds; swap preemptions), and each tier's
    # share in use, (("device", u), ("host", u), ("disk", u)) for the tiers configured.
    kv_cache: KVCacheStats | None = None
    kv_tier_usage: tuple[tuple[str, float], ...] = ()

    @staticmethod
    def combine(stats: list[EngineStats]) -> EngineStats:
        """Several replicas as one: counts summed, KV usage (each tier's) the mean; expert loads summed and each layer's
        max/mean device load the worst replica's (only when every replica has the same expert layout)."""
        loads = [s.expert_load for s in stats]
        expert_load, max_over_mean = (), ()
        if loads and loads[0] and all(len(load) == len(loads[0]) for load in loads):
            expert_load = tuple(tuple(map(sum, zip(*layer))) for layer in zip(*loads))
            max_over_mean = tuple(map(max, zip(*(s.expert_device_load_max_over_mean for s in stats))))
        kv_stats = [s.kv_cache for s in stats if s.kv_cache is not None]
        kv_cache = KVCacheStats(*(sum(getattr(kv, f.name) for kv in kv_stats)
                                  for f in dataclasses.fields(KVCacheStats))) if kv_stats else None
        usage: dict[str, list[float]] = {}
        for s in stats:
            for tier, share in s.kv_tier_usage:
                usage.setdefault(tier, []).append(share)
        return EngineStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                           sum(s.kv_cache_usage for s in stats) / max(len(stats), 1),
                           sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats),
                           sum(s.num_preemptions for s in stats), expert_load, max_over_mean,
                           sum(s.spec_draft_tokens for s in stats), sum(s.spec_accepted_tokens for s in stats),
                           sum(s.spec_drafts for s in stats),
                           tuple(map(sum, itertools.zip_longest(*(s.spec_accepted_per_position for s in stats),
                                                                fillvalue=0))),
                           kv_cache, tuple((tier, sum(v) / len(v)) for tier, v in usage.items()))


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer | None  # None with model.skip_tokenizer_init
    max_model_len: int
    vocab_size: int
    # The checkpoint's generation_config.json sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, ...), which vLLM applies to requests that do not set them.
    sampling_defaults: dict[str, Any]

    def prepare_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                        request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                        tenant: str | None = None, strict: bool = False) -> PreparedRequest:
        """Validate and tokenize (ValueError naming the parameter); queues nothing. `strict`: max_tokens
        past the context is an error instead of generation stopping at max_model_len."""
        ...

    def enqueue(self, prepared: PreparedRequest) -> None: ...

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, **kwargs: Any) -> str: ...

    def abort_request(self, request_ids: str | list[str]) -> None: ...

    def step(self, final_only: bool = False) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None:
        """Shut down (the engine takes no more steps): with a KV disk tier, the cached KV blocks are written
        there first, so a restart finds them. Idempotent."""
        ...
