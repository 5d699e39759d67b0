"""Summarize a jax.profiler perfetto trace (perfetto_trace.json.gz): time per event name per thread.

    python scripts/trace_summary.py TRACE_DIR_OR_FILE [--top 25] [--steps N [--by-kernel]]

--steps N: device busy time per step by kernel kind (the trace holds N steps); with --by-kernel, also
one step's kernels on GPU 0's busiest stream, by name: total, count and mean us (a middle step).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=0, help="with N > 0: device time per step by kernel kind")
    parser.add_argument("--by-kernel", action="store_true", help="with --steps: one step's kernels by name")
    args = parser.parse_args()
    path = args.path
    if os.path.isdir(path):
        path = sorted(glob.glob(os.path.join(path, "**", "*.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("thread_name", "process_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    by_thread = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (names.get((e["pid"], None), e["pid"]), names.get((e["pid"], e.get("tid")), e.get("tid")))
        stat = by_thread[key][e["name"][:90]]
        stat[0] += 1
        stat[1] += float(e.get("dur", 0))
    if args.steps:
        device_table(events, names, args.steps)
        if args.by_kernel:
            kernel_table(events, names, args.steps, args.top)
    for key, stats in sorted(by_thread.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        total = sum(v[1] for v in stats.values())
        print(f"\n== {key[0]} / {key[1]}: {total / 1e3:.2f} ms in {sum(v[0] for v in stats.values())} events")
        for name, (count, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {dur / 1e3:9.3f} ms {count:6d}x  {name}")


KINDS = (("all_reduce", ("all_reduce", "allreduce", "mosaic")), ("attention", ("attention", "paged", "triton")),
         ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "dot")), ("copy", ("memcpy", "memset")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def gpu_streams(events, names) -> dict[tuple, list]:
    """The complete events of each GPU stream, by (device name, stream name)."""
    streams = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        pname = str(names.get((e["pid"], None), e["pid"]))
        if "/device:GPU" in pname:
            streams[(pname, names.get((e["pid"], e.get("tid")), e.get("tid")))].append(e)
    return streams


def device_table(events, names, steps: int) -> None:
    """Per GPU stream: busy ms per step by kernel kind, kernels per step, and the span of the trace."""
    for key, evs in sorted(gpu_streams(events, names).items(), key=lambda kv: str(kv[0])):
        kinds = collections.defaultdict(float)
        for e in evs:
            kinds[kind_of(e["name"])] += float(e.get("dur", 0))
        busy = sum(kinds.values())
        span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in evs) - min(float(e["ts"]) for e in evs)
        parts = " ".join(f"{k}={v / steps / 1e3:.3f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(f"{key[0]} / {key[1]}: busy {busy / steps / 1e3:.3f} ms/step ({len(evs) / steps:.0f} kernels), "
              f"span {span / 1e3:.2f} ms; {parts}")


def kernel_table(events, names, steps: int, top: int) -> None:
    """GPU 0's busiest stream cut into `steps` equal runs of kernels; the middle one, by kernel name."""
    streams = [[e for e in evs if e.get("dur")] for (device, _), evs in gpu_streams(events, names).items()
               if "/device:GPU:0" in device]
    if not streams:
        return
    evs = sorted(max(streams, key=len), key=lambda e: float(e["ts"]))
    per_step = len(evs) // steps
    step = evs[per_step * (steps // 2): per_step * (steps // 2 + 1)]
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in step:
        stats[e["name"][:60]][0] += 1
        stats[e["name"][:60]][1] += float(e["dur"])
    print(f"\none step on GPU 0 ({per_step} kernels, busy {sum(v[1] for v in stats.values()):.0f} us):")
    for name, (count, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {dur:9.1f} us {count:5d}x {dur / count:7.2f}  {name}")


if __name__ == "__main__":
    main()
