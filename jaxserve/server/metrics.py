"""Prometheus metrics with vLLM's names under the `jaxserve:` prefix, one registry per app.

    engine thread, after each step:  record_step(engine.stats()) -> gauges (running, waiting, KV usage)
                                                      and the prefix-cache / preemption counters (from the
                                                      engine's totals; with data parallelism, over the
                                                      replicas: counts summed, KV usage the mean); with
                                                      expert parallelism it keeps the per-expert load and
                                                      each MoE layer's max/mean expert-device load
                                                      the KV cache tiers' counters and usage per tier
                                                      (kv_tier_*{tier=...}, kv_swaps{direction=...})
    engine thread, per output:       record_arrival / record_tokens / record_finished
                                                   -> token counters, TTFT / ITL / E2E histograms
    (With the engine in its own process, bridge.ProcessBridge makes these calls on the event loop, per step
    frame of the engine process; record_step with each frame that carries stats.)
    GET /metrics:                    render() -> the expert gauges from the latest step, then the text
                                                      exposition format

Every metric carries a `model_name` label, as vLLM's do, so dashboards built for vLLM work unchanged.
Times are `time.monotonic()` seconds taken by the engine (RequestOutput.metrics).
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from jaxserve.engine_client import EngineStats
from jaxserve.outputs import RequestOutput

PREFIX = "jaxserve:"
disable_created_metrics()  # no `*_created` series per counter and histogram (vLLM does the same)
CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                1920.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Requests being computed (prefill or decode).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use, from 0 to 1.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV blocks ran out).")
        self.spec_drafts = counter("spec_decode_num_drafts", "Steps of a request with speculative guesses.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative guesses scored.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative guesses accepted.")
        self._spec_per_position = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Speculative guesses accepted, by guess position (0: the first).",
                                          ["model_name", "position"], registry=self.registry)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _E2E_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        # Expert parallelism only (no series without it): labelled by MoE layer (its index among the MoE
        # layers, the placement tables' row) and logical expert.
        self._expert_load = Gauge(PREFIX + "expert_load", "Tokens routed to each logical expert since the last "
                                  "expert rebalance, per MoE layer.", ["model_name", "layer", "expert"],
                                  registry=self.registry)
        self._expert_balance = Gauge(PREFIX + "expert_device_load_max_over_mean",
                                     "Busiest expert device's load over the mean device's, per MoE layer "
                                     "(1 = balanced), for the load since the last expert rebalance.",
                                     ["model_name", "layer"], registry=self.registry)
        self._model_name = model_name
        self._tiers = KVTierMetrics(self.registry, model_name)
        self._expert_stats: tuple[tuple, tuple] = ((), ())  # the latest step's, exported at scrape time
        self._seen_queries = self._seen_hits = self._seen_preemptions = 0
        self._seen_drafts = self._seen_draft_tokens = self._seen_accepted = 0
        self._seen_per_position: tuple[int, ...] = ()

    def record_step(self, stats: EngineStats) -> None:
        """The engine's state after a step (its counters are totals: the counters here advance by the change)."""
        queries, hits, preemptions = stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(queries - self._seen_queries)
        self.prefix_hits.inc(hits - self._seen_hits)
        self.preemptions.inc(preemptions - self._seen_preemptions)
        self._seen_queries, self._seen_hits, self._seen_preemptions = queries, hits, preemptions
        self.spec_drafts.inc(stats.spec_drafts - self._seen_drafts)
        self.spec_draft_tokens.inc(stats.spec_draft_tokens - self._seen_draft_tokens)
        self.spec_accepted.inc(stats.spec_accepted_tokens - self._seen_accepted)
        self._seen_drafts, self._seen_draft_tokens = stats.spec_drafts, stats.spec_draft_tokens
        self._seen_accepted = stats.spec_accepted_tokens
        seen = self._seen_per_position
        for position, count in enumerate(stats.spec_accepted_per_position):
            previous = seen[position] if position < len(seen) else 0
            if count > previous or position >= len(seen):  # (a position's series exists once it is seen)
                self._spec_per_position.labels(self._model_name, str(position)).inc(count - previous)
        self._seen_per_position = stats.spec_accepted_per_position
        self._tiers.record(stats)
        # NOTE: one labelled gauge per (MoE layer, expert) costs tens of ms to set: the engine thread keeps
        # only the (immutable) tuples, and render() writes the gauges when /metrics is read.
        self._expert_stats = (stats.expert_load, stats.expert_device_load_max_over_mean)

    def record_arrival(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, output: RequestOutput, num_new: int, is_first: bool,
                      gaps: list[tuple[int, float]]) -> None:
        """`num_new` tokens of `output` (over its n sequences) reached the host; `is_first`: the request's
        first ones. `gaps` holds, per sequence that had tokens before, (its new tokens, seconds since its
        previous token): inter-token latency is per sequence, so n sequences stepping together do not
        divide it by n."""
        if num_new <= 0:
            return
        self.generation_tokens.inc(num_new)
        if is_first:
            self.ttft.observe(output.metrics.first_token_time - output.metrics.arrival_time)
        for count, seconds in gaps:
            for _ in range(count):
                self.itl.observe(seconds / count)

    def record_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics.finished_time is not None and any(c.finish_reason != "abort" for c in output.outputs):
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        for completion in output.outputs:
            self._success.labels(self._model_name, completion.finish_reason or "abort").inc()

    def render(self) -> bytes:
        expert_load, balance = self._expert_stats
        for layer, loads in enumerate(expert_load):
            for expert, tokens in enumerate(loads):
                self._expert_load.labels(self._model_name, str(layer), str(expert)).set(tokens)
        for layer, ratio in enumerate(balance):
            self._expert_balance.labels(self._model_name, str(layer)).set(ratio)
        return generate_latest(self.registry)


# The KV cache tiers' counters: metric name -> (KVCacheStats field per tier, help). Tiers: host, disk
# (device: evictions only; the device's hits are prefix_cache_hits).
_TIER_COUNTERS = {
    "kv_tier_hits": ("{}_hits", "Tokens found in a KV cache tier after the tiers above missed."),
    "kv_tier_misses": ("{}_misses", "Tokens looked up in a KV cache tier and not found."),
    "kv_tier_bytes_in": ("{}_bytes_in", "Bytes written into a KV cache tier."),
    "kv_tier_bytes_out": ("{}_bytes_out", "Bytes read out of a KV cache tier."),
    "kv_tier_evictions": ("{}_evictions", "KV blocks evicted from a tier (device: cached blocks reused)."),
    "kv_tier_loads": ("{}_loads", "Loads out of a KV cache tier (host: one step's blocks; disk: one block)."),
    "kv_tier_load_seconds": ("{}_load_seconds", "Seconds the loads out of a KV cache tier took, asked to "
                                                "landed (divide by kv_tier_loads for the mean)."),
}


class KVTierMetrics:
    """Per-tier series of the KV cache tiers: one counter family per quantity labelled by tier, the
    usage of each tier, and swap preemptions out and in. No series until an engine reports tiers."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name", "tier"]
        self._counters = {name: Counter(PREFIX + name, doc, labels, registry=registry)
                          for name, (_, doc) in _TIER_COUNTERS.items()}
        self._usage = Gauge(PREFIX + "kv_tier_usage_perc", "Share of a KV cache tier in use, from 0 to 1 "
                            "(device: blocks held by requests; host: slots; disk: bytes of its cap).", labels,
                            registry=registry)
        self._swaps = Counter(PREFIX + "kv_swaps", "Requests preempted by swapping their KV blocks to host (out) "
                              "and resumed from there (in).", ["model_name", "direction"], registry=registry)
        self._model_name = model_name
        self._seen: dict[tuple[str, str], float] = {}

    def _advance(self, counter: Counter, label: str, key: tuple[str, str], total: float) -> None:
        counter.labels(self._model_name, label).inc(max(0.0, total - self._seen.get(key, 0)))
        self._seen[key] = total

    def record(self, stats: EngineStats) -> None:
        kv = stats.kv_cache
        tiers = [tier for tier, _ in stats.kv_tier_usage if tier != "device"]
        if kv is None or not tiers:
            return
        for tier, share in stats.kv_tier_usage:
            self._usage.labels(self._model_name, tier).set(share)
        self._advance(self._counters["kv_tier_evictions"], "device", ("kv_tier_evictions", "device"), kv.evictions)
        for tier in tiers:
            for name, (field, _) in _TIER_COUNTERS.items():
                self._advance(self._counters[name], tier, (name, tier), getattr(kv, field.format(tier)))
        self._advance(self._swaps, "out", ("kv_swaps", "out"), kv.swaps_out)
        self._advance(self._swaps, "in", ("kv_swaps", "in"), kv.swaps_in)
