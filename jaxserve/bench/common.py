"""Shared parts of `jaxserve bench throughput` and `jaxserve bench latency`.

    engine flags (vLLM's names) --engine_config--> EngineConfig --make_engine--> Engine(record_step_stats=True)
    prompts + SamplingParams --run_batch--> BatchRun(outputs, wall seconds, the run's StepStats)
    --request_report / step_report / roofline--> one report dict --print_report, write_json (--output-json)

Definitions. Request times come from RequestOutput.metrics (time.monotonic()), step times from the
engine's StepStats (time.perf_counter()); only differences within one clock are taken.
    TTFT = first_token_time - arrival_time (arrival: the request was validated and queued)
    TPOT = (finished_time - first_token_time) / (num_output_tokens - 1), requests with >= 2 tokens
    ITL  = t_end[k] - t_end[k-1], counted once per decode row of step k (each decode row receives its
           token when step k's results are processed); decode rows = num_tokens - num_prefill_tokens
    device time of step k = done_t[k] - max(dispatch_t[k], done_t[k-1]); idle share: device_idle_share

Roofline of a memory-bound decode step on one H200 (HBM copy bandwidth measured at 4.3e12 B/s):
    bytes per step     = W_read + B * C * kv_bytes_per_token
    W_read             = bytes of the weights a step reads: all of them for a dense model (the
                         embedding table included, as the decode targets count them, though a step
                         only gathers B of its rows: ~6% of W for the Llama-3-8B shape); for a
                         mixture of experts, every non-expert weight (attention, router, embedding,
                         dense layers) plus, per MoE layer, the expected distinct experts touched x
                         one routed expert's bytes (its gate, up and down projections)
    experts touched    = E * (1 - (1 - k / E)^B) per MoE layer, for B rows each routed to top-k of
                         E experts: exactly k at B = 1, all E for large B. It assumes uniform,
                         independent routing (random dummy weights route near-uniformly; a trained
                         router's skew touches fewer); padding rows of a bucket above B are routed
                         too and are not counted
    kv_bytes_per_token = num_layers * 2 (K and V) * num_kv_heads * head_dim * the KV cache dtype's bytes
                         (the model's; 1 with --kv-cache-dtype fp8)
    roofline tokens/s  = B / (bytes per step / 4.3e12)
with B the decode rows per step and C the mean context (prompt + half the output) over the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.bench import spec
from jaxserve.cli import DEFAULT_CONFIG
from jaxserve.config import EngineConfig, load_config
from jaxserve.engine import Engine
from jaxserve.models import moe, registry
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_stats import StepStats, device_idle_share

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy bandwidth, measured
PERCENTILES = (50, 90, 99)

# flag dest -> EngineConfig field (routed to its section by EngineConfig.with_overrides)
ENGINE_FLAGS = ("model", "tokenizer", "load_format", "dtype", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "block_size", "num_blocks", "enable_prefix_caching", "async_scheduling",
                "attention_backend", "precompile", "skip_tokenizer_init", "all_reduce", "host_kv_gib", "disk_kv_path",
                "disk_kv_gib", "prefix_hash_seed", "preemption_mode", "quantization", "kv_cache_dtype",
                "flash_prefill_token_threshold")


def parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags: each one given overrides the config file's value."""
    group = parser.add_argument_group("engine (each flag overrides the config)")
    group.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                       help=f"engine config YAML (default: {DEFAULT_CONFIG.name}, the embedded model)")
    group.add_argument("--model", help="local HF checkpoint directory (with --load-format dummy only its "
                                       "config.json is read)")
    group.add_argument("--tokenizer", help="tokenizer directory, used even where the config skips the tokenizer "
                                           "(default: the model's; for --load-format dummy, e.g. one made by "
                                           "benchmarks/make_synthetic_tokenizer.py)")
    group.add_argument("--load-format", choices=("auto", "dummy"), help="dummy: random weights, no safetensors")
    group.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"))
    group.add_argument("--quantization", choices=("fp8",), help="fp8: FP8 weights, quantized at load (README "
                                                                "\"FP8 weights\")")
    group.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"),
                       help="fp8: a float8_e4m3fn KV cache (README \"FP8 KV cache\")")
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--max-num-seqs", type=int)
    group.add_argument("--max-num-batched-tokens", type=int)
    group.add_argument("--block-size", type=int)
    group.add_argument("--num-blocks", type=int, help="exact KV cache size in blocks (vLLM: num-gpu-blocks-override)")
    group.add_argument("--enable-prefix-caching", type=parse_bool, metavar="{true,false}")
    group.add_argument("--async-scheduling", type=parse_bool, metavar="{true,false}",
                       help="overlap step N+1's dispatch with step N's readback")
    group.add_argument("--attention-backend", choices=("auto", "reference", "pallas"))
    group.add_argument("--flash-prefill-token-threshold", type=int,
                       help="a request with at least this many of a step's tokens prefills through the flash "
                            "attention (0: off; README \"Long context\")")
    group.add_argument("--precompile", type=parse_bool, metavar="{true,false}",
                       help="compile every bucket at start-up (default: the config's)")
    group.add_argument("--skip-tokenizer-init", action="store_const", const=True,
                       help="no tokenizer: prompts must be token ids")
    group.add_argument("--host-kv-gib", "--kv-offloading-size", dest="host_kv_gib", type=float,
                       help="KV cache host tier, GiB (0: off)")
    group.add_argument("--disk-kv-path", help="KV cache disk tier directory (with --disk-kv-gib)")
    group.add_argument("--disk-kv-gib", type=float, help="the disk tier's size cap, GiB")
    group.add_argument("--prefix-hash-seed", type=int,
                       help="root of the prefix-cache keys (engines sharing a disk tier)")
    group.add_argument("--preemption-mode", choices=("auto", "recompute", "swap"))
    group.add_argument("--all-reduce", choices=("auto", "xla", "one_shot"),
                       help="tensor parallelism's all-reduces: auto (the one-shot kernel on GPUs of one process), "
                            "xla or one_shot")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts")
    parser.add_argument("--disable-detokenize", action="store_true", help="token ids only, no text")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--output-json", type=Path, help="write the full report here")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    if "tokenizer" in overrides:  # a tokenizer given is used, also over a config's skip_tokenizer_init
        overrides.setdefault("skip_tokenizer_init", False)
    return spec.apply(load_config(args.config, **overrides, **spec.engine_overrides(args)), args)


def make_engine(config: EngineConfig, progress: bool) -> tuple[Engine, float]:
    """The engine, recording its steps (`engine.step_stats`), and the seconds it took to start (the bench
    is where speculative.synthetic_acceptance is allowed)."""
    start = time.monotonic()
    engine = Engine(config, progress, record_step_stats=True, allow_synthetic_acceptance=True)
    return engine, time.monotonic() - start


def random_prompts(rng: np.random.Generator, count: int, length: int, vocab_size: int) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": rng.integers(0, vocab_size, length).tolist()} for _ in range(count)]


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=not args.disable_detokenize)


@dataclasses.dataclass
class BatchRun:
    outputs: list[RequestOutput]  # in input order
    elapsed_s: float  # from validating the first request to the last one finished
    steps: list[StepStats]  # this run's step records


def run_batch(engine: Engine, prompts: list[dict[str, Any]], params: list[SamplingParams], progress: bool,
              desc: str = "requests") -> BatchRun:
    """Queue every prompt at once (after validating all) and step until every one has finished."""
    engine.step_stats.clear()
    start = time.perf_counter()
    prepared = [engine.prepare_request(prompt, sp) for prompt, sp in zip(prompts, params)]
    order = {p.request_id: index for index, p in enumerate(prepared)}
    for p in prepared:
        engine.enqueue(p)
    outputs: list[RequestOutput | None] = [None] * len(prepared)
    with tqdm(total=len(prepared), desc=desc, disable=not progress, leave=False) as bar:
        remaining = len(prepared)
        while remaining:
            for output in engine.step(final_only=True):
                if output.finished and output.request_id in order:
                    outputs[order[output.request_id]] = output
                    remaining -= 1
                    bar.update()
    elapsed = time.perf_counter() - start
    # NOTE: with overlap, the step dispatched while the last request finished (by eos or a stop) is
    # still in flight; has_unfinished_requests() does not count it (its tokens are dropped). One more
    # step() processes it and dispatches nothing, so its record is complete in this run and the next
    # run starts from an idle engine.
    engine.step()
    return BatchRun(outputs, elapsed, list(engine.step_stats))  # type: ignore[arg-type]


def summary(values_s, weights=None) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds; `weights` repeats each value (ITL: decode rows per step)."""
    values = np.asarray(values_s, np.float64) * 1e3
    if weights is not None:
        values = np.repeat(values, np.asarray(weights, np.int64))
    if values.size == 0:
        return None
    return {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES},
            "max": float(values.max()), "count": int(values.size)}


def request_report(outputs: list[RequestOutput]) -> dict[str, Any]:
    ttft, tpot = [], []
    for out in outputs:
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        num_output = len(out.outputs[0].token_ids)
        if num_output >= 2:
            tpot.append((m.finished_time - m.first_token_time) / (num_output - 1))
    return {"ttft_ms": summary(ttft), "tpot_ms": summary(tpot)}


def step_report(runs: list[list[StepStats]]) -> dict[str, Any]:
    """ITL, mean per-step times and the device idle share over one or more runs."""
    itl, itl_rows, decode_rows, device, idle_time, wall = [], [], [], [], 0.0, 0.0
    for steps in runs:
        steps = sorted(steps, key=lambda s: s.step)
        for prev, cur in zip(steps, steps[1:]):
            rows = cur.num_tokens - cur.num_prefill_tokens
            if rows:
                itl.append(cur.t_end - prev.t_end)
                itl_rows.append(rows)
        decode_rows += [s.num_tokens - s.num_prefill_tokens for s in steps if s.num_tokens > s.num_prefill_tokens]
        done = [s for s in steps if s.done_t > 0]
        previous_done = [s.dispatch_t for s in done[:1]] + [s.done_t for s in done[:-1]]
        device += [s.done_t - max(s.dispatch_t, prev) for s, prev in zip(done, previous_done)]
        if len(done) >= 2:
            run_wall = done[-1].done_t - done[0].dispatch_t
            idle_time += device_idle_share(done) * run_wall
            wall += run_wall
    every = [s for steps in runs for s in steps]
    # Steady decode: steps of decode rows only, at the run's largest batch, after another such step.
    # Their t_end spacing is the decode step time the batch sees (ITL without prefill interference).
    full, steady = max(decode_rows, default=0), []
    for steps in runs:
        steps = sorted(steps, key=lambda s: s.step)
        steady += [cur.t_end - prev.t_end for prev, cur in zip(steps, steps[1:])
                   if cur.num_prefill_tokens == prev.num_prefill_tokens == 0 and cur.num_tokens == prev.num_tokens == full]

    def mean_ms(values) -> float | None:
        return float(np.mean(values) * 1e3) if len(values) else None

    return {
        "num_steps": len(every),
        "num_prefill_steps": sum(1 for s in every if s.num_prefill_tokens),
        "mean_tokens_per_step": float(np.mean([s.num_tokens for s in every])) if every else None,
        "mean_decode_rows_per_step": float(np.mean(decode_rows)) if decode_rows else None,
        "itl_ms": summary(itl, itl_rows),
        "steady_decode": {"batch": full, "num_steps": len(steady),
                          "step_ms": summary(steady),
                          "tokens_per_s": full / float(np.median(steady)) if steady else None},
        "breakdown_ms": {
            "schedule": mean_ms([s.schedule_s for s in every]),
            "prepare": mean_ms([s.prepare_s for s in every]),
            "device": mean_ms(device),
            "readback": mean_ms([s.readback_s for s in every]),
            "update": mean_ms([s.update_s for s in every]),
        },
        "device_idle_share": idle_time / wall if wall > 0 else None,
    }


def expected_experts_touched(num_experts: int, top_k: int, rows: float) -> float:
    """Expected distinct experts that `rows` token rows touch in one MoE layer when each row picks top_k
    of num_experts uniformly at random: E * (1 - (1 - k / E)^B), exactly top_k for one row."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def _weight_bytes(cfg) -> tuple[int, int]:
    """(bytes of all weights, bytes of the routed experts' weights among them). Routed expert tensors
    are the MoE layers' parameters whose first axis is the experts (moe.AXES)."""
    abstract_params = registry.family_of(cfg).abstract(cfg)
    total = expert = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        nbytes = leaf.size * leaf.dtype.itemsize
        total += nbytes
        name = getattr(path[-1], "key", None)
        if name in moe.AXES and moe.AXES[name][0] == "experts":
            expert += nbytes
    return total, expert


def roofline(cfg, batch: float, mean_context: float, num_devices: int = 1,
             bandwidth: float = HBM_BYTES_PER_S, kv_dtype=None) -> dict[str, float]:
    """Decode tokens/s if a step only had to read the weights it uses and the batch's KV once (module
    docstring). Under tensor parallelism each of the `num_devices` devices reads its share at its own
    bandwidth. `kv_dtype`: the KV cache's dtype (the runner's kv_dtype; default the model's), 1 byte an
    element for an fp8 cache; the weights' bytes are the params' own (FP8 weights and their scales)."""
    bandwidth = bandwidth * num_devices
    weight_bytes, expert_bytes = _weight_bytes(cfg)
    spec = getattr(cfg, "moe", None)
    report: dict[str, float] = {}
    read_bytes = weight_bytes
    if spec is not None:
        layers = len(spec.sparse_layers)
        one_expert = expert_bytes / (layers * spec.num_experts)
        touched = expected_experts_touched(spec.num_experts, spec.top_k, batch)
        touched_bytes = layers * touched * one_expert
        read_bytes = weight_bytes - expert_bytes + touched_bytes
        report = {"expert_bytes": expert_bytes, "one_expert_bytes": one_expert, "experts_touched_per_layer": touched,
                  "touched_expert_bytes": touched_bytes}
    kv_itemsize = np.dtype(cfg.jnp_dtype if kv_dtype is None else kv_dtype).itemsize
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    step_bytes = read_bytes + batch * mean_context * kv_bytes_per_token
    return {"batch": batch, "mean_context": mean_context, "weight_bytes": weight_bytes,
            "read_weight_bytes": read_bytes, **report,
            "kv_bytes_per_token": kv_bytes_per_token, "bytes_per_step": step_bytes,
            "bandwidth_bytes_per_s": bandwidth, "tokens_per_s": batch * bandwidth / step_bytes}


def engine_report(engine: Engine, init_s: float) -> dict[str, Any]:
    return {"num_compiled": engine.num_compiled, "startup_compile_s": engine.startup_seconds,
            "slowest_compiles": engine.runner.slowest_compiles, "engine_init_s": init_s,
            "attention_backend": engine.runner.attention_backend,
            "num_kv_blocks": engine.runner.num_blocks, "num_preemptions": engine.stats().num_preemptions,
            "device": str(jax.devices()[0].device_kind),
            "kv_cache": kv_cache_report(engine), "config": engine.config.to_dict()}


def kv_cache_report(engine: Engine) -> dict[str, Any]:
    """The KV cache's totals (kv_cache_manager.KVCacheStats: prefix hits, device evictions, per tier below it
    hits, misses, bytes, evictions, loads and their seconds; swaps), the prefix hit rate, each tier's share of
    the hits and mean load ms, and each tier's usage at the end."""
    stats = engine.stats()
    if stats.kv_cache is None:
        return {}
    kv = stats.kv_cache
    report: dict[str, Any] = dataclasses.asdict(kv)
    report["hit_rate"] = kv.hit_rate
    report["usage"] = dict(stats.kv_tier_usage)
    for tier in ("host", "disk"):
        report[f"{tier}_hit_rate"] = report[f"{tier}_hits"] / kv.queries if kv.queries else 0.0
        loads = report[f"{tier}_loads"]
        report[f"{tier}_mean_load_ms"] = 1e3 * report[f"{tier}_load_seconds"] / loads if loads else None
    return report


def kv_line(kv: dict[str, Any]) -> str | None:
    tiers = [tier for tier in ("host", "disk") if tier in kv.get("usage", {})]
    if not tiers:
        return None
    parts = [f"prefix hits {kv['hit_rate']:.1%} of {kv['queries']} tokens"]
    for tier in tiers:
        load = kv[f"{tier}_mean_load_ms"]
        parts.append(f"{tier}: hits {kv[f'{tier}_hit_rate']:.1%}, {kv[f'{tier}_bytes_in'] / 1e6:.1f} MB in / "
                     f"{kv[f'{tier}_bytes_out'] / 1e6:.1f} MB out, {kv[f'{tier}_evictions']} evicted, "
                     f"{kv[f'{tier}_loads']} loads{'' if load is None else f' ({load:.2f} ms mean)'}, "
                     f"usage {kv['usage'][tier]:.0%}")
    parts.append(f"swaps out/in {kv['swaps_out']}/{kv['swaps_in']}")
    return "KV cache: " + "; ".join(parts)


def _fmt(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "n/a"
    return f"mean {stats['mean']:.2f}  " + "  ".join(f"p{q} {stats[f'p{q}']:.2f}" for q in PERCENTILES)


def print_report(report: dict[str, Any]) -> None:
    """The lines both modes share: speculative decoding's counters, latencies, the step breakdown,
    compilation, the roofline."""
    for line in spec.describe(report.get("spec_decode")):
        print(line)
    for name in ("ttft_ms", "tpot_ms"):
        if name in report:
            print(f"{name[:-3].upper():5s} ms: {_fmt(report[name])}")
    steps = report["steps"]
    print(f"ITL   ms: {_fmt(steps['itl_ms'])}")
    steady = steps["steady_decode"]
    if steady["tokens_per_s"] is not None:
        print(f"steady decode (batch {steady['batch']}, {steady['num_steps']} pure-decode steps): "
              f"{steady['tokens_per_s']:.1f} tokens/s, step ms {_fmt(steady['step_ms'])}")
    parts = "  ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in steps["breakdown_ms"].items())
    idle = steps["device_idle_share"]
    print(f"step  ms (mean of {steps['num_steps']} steps): {parts}")
    print(f"device idle between steps: {'n/a' if idle is None else f'{idle:.1%}'}")
    engine = report["engine"]
    if (line := kv_line(engine.get("kv_cache", {}))) is not None:
        print(line)
    print(f"compiled shapes: {engine['num_compiled']}  start-up compile: {engine['startup_compile_s']:.1f} s  "
          f"(engine init {engine['engine_init_s']:.1f} s, {engine['device']}, {engine['attention_backend']})")
    if engine.get("slowest_compiles"):
        print("slowest compiles: " + ", ".join(f"{key} {s:.1f} s" for key, s in engine["slowest_compiles"]))
    roof = report["roofline"]
    if "touched_expert_bytes" in roof:
        print(f"experts: {roof['experts_touched_per_layer']:.1f} touched per MoE layer (uniform routing), "
              f"{roof['touched_expert_bytes'] / 1e9:.2f} of {roof['expert_bytes'] / 1e9:.2f} GB of expert weights; "
              f"{roof['read_weight_bytes'] / 1e9:.2f} GB of weights read per step")
    print(f"roofline (B={roof['batch']:.1f}, mean context {roof['mean_context']:.0f}, "
          f"{roof['bytes_per_step'] / 1e9:.2f} GB/step at {roof['bandwidth_bytes_per_s'] / 1e12:.1f} TB/s): "
          f"{roof['tokens_per_s']:.1f} tokens/s; measured share "
          f"{'n/a' if report['roofline_share'] is None else format(report['roofline_share'], '.1%')}")


def args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")


def run_main(body, argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Parse, run `body(args)`, and turn a bad input into one error line and exit status 2."""
    args = parser.parse_args(argv)
    try:
        body(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
