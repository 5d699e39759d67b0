"""Summarize a jax.profiler perfetto trace (perfetto_trace.json.gz): time per event name per thread.

    python scripts/trace_summary.py TRACE_DIR_OR_FILE [--top 25]
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
    for key, stats in sorted(by_thread.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        total = sum(v[1] for v in stats.values())
        print(f"\n== {key[0]} / {key[1]}: {total / 1e3:.2f} ms in {sum(v[0] for v in stats.values())} events")
        for name, (count, dur) in sorted(stats.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {dur / 1e3:9.3f} ms {count:6d}x  {name}")


if __name__ == "__main__":
    main()
