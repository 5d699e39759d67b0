"""Where a bench run's device time goes: `jaxserve bench latency`'s engine and arguments, one iteration
traced with the JAX profiler after the warm-up, and the GPU kernels of the trace summed by name.

    python3 benchmarks/profile_step.py BENCH-LATENCY-ARGS... [--trace-dir DIR] [--top 25] [--host-top N]

e.g. `python3 benchmarks/profile_step.py --config configs/llama3-8b-dummy.yaml --batch-size 1
--input-len 128 --output-len 64 --num-iters-warmup 1 --num-iters 1 --quantization fp8`. The first
--spec-synthetic-acceptance value, when given, is the one traced. Prints the traced window's engine steps,
the device's busy time per step (the union of kernel intervals on the GPU's streams) against the window's
wall time per step, and the kernels with the most time: calls and microseconds per step, and their share.
On a CPU the trace holds no GPU stream: the table says so. --host-top N: one more iteration, untraced,
under cProfile, and its N functions with the most cumulative time per engine step (the host's side).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gzip
import io
import json
import pstats
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve.bench import common, latency, spec


def trace_events(trace_dir: Path) -> list[dict]:
    """The trace events of the latest Perfetto trace under `trace_dir` (else its latest *.trace.json.gz)."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz")) or sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise SystemExit(f"no trace file under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _gpu_kernels(events: list[dict]) -> list[dict]:
    """The complete events on a GPU's streams (processes named like /device:GPU:0)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if re.search(r"GPU|gpu", name)}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def _busy_us(kernels: list[dict]) -> float:
    """The union of the kernels' intervals (streams overlap)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, end = 0.0, -1.0
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def _short(name: str) -> str:
    name = re.sub(r"\.\d+$", "", name)
    return name if len(name) <= 60 else name[:57] + "..."


def _host_profile(iteration, top: int) -> None:
    profile = cProfile.Profile()
    profile.enable()
    run = iteration()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    print(f"host: {len(run.steps)} engine steps in {run.elapsed_s * 1e3:.1f} ms under cProfile "
          f"({run.elapsed_s * 1e3 / max(len(run.steps), 1):.3f} ms per step); cumulative seconds:")
    print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))


def main(argv: list[str]) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--trace-dir", type=Path, default=Path("/tmp/jaxserve-profile"))
    extra.add_argument("--top", type=int, default=25)
    extra.add_argument("--host-top", type=int, default=0)
    own, rest = extra.parse_known_args(argv)
    args = latency.build_parser().parse_args(rest)
    config = common.engine_config(args)
    engine, _ = common.make_engine(config, progress=False)
    rng = np.random.default_rng(args.seed)
    acceptance = spec.acceptances(args)[0]
    spec.set_acceptance(engine, acceptance)
    params = [common.sampling_params(args, args.output_len)] * args.batch_size

    def iteration():
        prompts = common.random_prompts(rng, args.batch_size, args.input_len, engine.vocab_size)
        return common.run_batch(engine, prompts, params, progress=False)

    for _ in range(args.num_iters_warmup):
        iteration()
    jax.profiler.start_trace(str(own.trace_dir), create_perfetto_trace=True)
    start = time.perf_counter()
    run = iteration()
    wall_s = time.perf_counter() - start
    jax.profiler.stop_trace()

    steps = len(run.steps)
    if own.host_top:
        _host_profile(iteration, own.host_top)
    kernels = _gpu_kernels(trace_events(own.trace_dir))
    print(f"traced: {steps} engine steps in {wall_s * 1e3:.1f} ms ({wall_s * 1e3 / max(steps, 1):.3f} ms per step), "
          f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out"
          + (f", synthetic acceptance {acceptance}" if acceptance is not None else ""))
    if not kernels:
        print("no GPU stream in the trace (a CPU run): nothing to sum")
        return 0
    busy = _busy_us(kernels)
    per_step = max(steps, 1)
    print(f"device busy {busy / 1e3:.1f} ms ({busy / per_step / 1e3:.3f} ms per step, "
          f"{busy / (wall_s * 1e6):.0%} of the wall time); {len(kernels) / per_step:.0f} kernels per step")
    totals, counts = collections.Counter(), collections.Counter()
    for e in kernels:
        totals[_short(e["name"])] += float(e["dur"])
        counts[_short(e["name"])] += 1
    total = sum(totals.values())
    print(f"{'kernel':60} {'calls/step':>10} {'us/step':>9} {'share':>6}")
    for name, us in totals.most_common(own.top):
        print(f"{name:60} {counts[name] / per_step:>10.1f} {us / per_step:>9.1f} {us / total:>6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
