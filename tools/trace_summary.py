"""Summarize a jax.profiler perfetto trace (perfetto_trace.json.gz): time per event name per thread.

    python tools/trace_summary.py TRACE_DIR_OR_FILE [--top 25] [--steps N [--by-kernel] [--gaps]]

--steps N: device busy time per step by kernel kind (the trace holds N steps); with --by-kernel, also
one step's kernels on GPU 0's busiest stream, by name: total, count and mean us (a middle step); with
--gaps, where each GPU's busiest stream sat idle (gaps between kernels, per step, the largest with
their neighbours) and, with two GPUs, how far apart the GPUs reach each all-reduce kernel.
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
    parser.add_argument("--gaps", action="store_true", help="with --steps: idle gaps per GPU, all-reduce skew")
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
        if args.gaps:
            gap_table(events, names, args.steps)
    for key, stats in sorted(by_thread.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        total = sum(v[1] for v in stats.values())
        print(f"\n== {key[0]} / {key[1]}: {total / 1e3:.2f} ms in {sum(v[0] for v in stats.values())} events")
        for name, (count, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {dur / 1e3:9.3f} ms {count:6d}x  {name}")


KINDS = (("all_reduce", ("all_reduce", "allreduce")), ("attention", ("attention", "paged", "triton")),
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
    evs = next((evs for device, evs in busiest_streams(events, names).items() if "/device:GPU:0" in device), None)
    if not evs:
        return
    per_step = len(evs) // steps
    step = evs[per_step * (steps // 2): per_step * (steps // 2 + 1)]
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in step:
        stats[e["name"][:60]][0] += 1
        stats[e["name"][:60]][1] += float(e["dur"])
    print(f"\none step on GPU 0 ({per_step} kernels, busy {sum(v[1] for v in stats.values()):.0f} us):")
    for name, (count, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {dur:9.1f} us {count:5d}x {dur / count:7.2f}  {name}")


def busiest_streams(events, names) -> dict[str, list]:
    """Each GPU's busiest stream, its kernels sorted by start time."""
    best = {}
    for (device, _), evs in gpu_streams(events, names).items():
        evs = [e for e in evs if e.get("dur")]
        if len(evs) > len(best.get(device, [])):
            best[device] = sorted(evs, key=lambda e: float(e["ts"]))
    return best


def gap_table(events, names, steps: int, min_gap_us: float = 2.0) -> None:
    """Idle time between kernels on each GPU (gaps of at least `min_gap_us`), per step, the largest
    ones with the kernels around them; then the all-reduce kernels' start skew between two GPUs."""
    streams = busiest_streams(events, names)
    for device, evs in sorted(streams.items()):
        end = lambda e: float(e["ts"]) + float(e["dur"])
        gaps = [(float(b["ts"]) - end(a), a, b) for a, b in zip(evs, evs[1:])]
        big = [g for g in gaps if g[0] >= min_gap_us]
        span = end(evs[-1]) - float(evs[0]["ts"])
        print(f"\n{device}: span {span / steps / 1e3:.3f} ms/step, gaps >= {min_gap_us:g} us: "
              f"{len(big) / steps:.1f} per step, {sum(g[0] for g in big) / steps:.1f} us per step")
        for gap, a, b in sorted(big, key=lambda g: -g[0])[:8]:
            print(f"  {gap:8.1f} us after {a['name'][:40]:40s} before {b['name'][:40]}")
    if len(streams) < 2:
        return
    (d0, evs0), (d1, evs1) = sorted(streams.items())[:2]
    ar0, ar1 = ([e for e in evs if kind_of(e["name"]) == "all_reduce"] for evs in (evs0, evs1))
    if not ar0 or len(ar0) != len(ar1):
        print(f"\nall-reduce kernels: {len(ar0)} on {d0}, {len(ar1)} on {d1}: not paired")
        return
    skew = sorted(float(b["ts"]) - float(a["ts"]) for a, b in zip(ar0, ar1))
    wait = sorted(abs(float(a["dur"]) - float(b["dur"])) for a, b in zip(ar0, ar1))
    mid = lambda xs: xs[len(xs) // 2]
    print(f"\nall-reduce kernels ({len(ar0)}): start of {d1} minus {d0}: median {mid(skew):.1f} us, "
          f"min {skew[0]:.1f}, max {skew[-1]:.1f}; |duration difference| median {mid(wait):.1f} us, "
          f"total {sum(wait) / steps:.1f} us per step")


if __name__ == "__main__":
    main()
