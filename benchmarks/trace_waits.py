"""What the slow engine-thread calls of a `benchmarks/host_timers.py` trace waited for.

    HOST_TIMERS_TRACE=/tmp/tr python3 benchmarks/host_timers.py bench multi-turn ... --host-kv-gib 32
    PYTHONPATH=. python3 benchmarks/trace_waits.py /tmp/tr [--min-ms 10] [--top 8]   (from the repository root)

For each of the slowest timed calls (host_timers' named slices, e.g. `KVTransfer.run`,
`ModelRunner._run_forward`) longer than --min-ms: the runtime's slices nested in it on the same thread, by
their own time (where the call spent it: an executable's enqueue, a wait for an event or a stream), and the device's
work overlapping it per stream (kernels and copies), with how long before the call returned the device's
last piece of work in the window ended (a call that returns just after the device drains waited for it).
Then, per timed label, its slow calls' count and seconds.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from benchmarks.profile_step import trace_events

LABEL_PREFIXES = ("KVTransfer.", "ModelRunner.", "Scheduler.", "KVCacheManager.", "TierLink.")


def load(directory: str) -> list[dict]:
    """The trace's complete events ("X") with their process and thread names as "process" and "thread"."""
    events = trace_events(Path(directory))
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    out = []
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            e["process"] = processes.get(e["pid"], str(e["pid"]))
            e["thread"] = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
            out.append(e)
    return out


def is_device(event: dict) -> bool:
    name = event["process"].lower()
    return "/device:" in name or "gpu" in name or "tpu" in name


def self_times(call: dict, host: list[dict]) -> collections.Counter:
    """The runtime's slices nested in `call` on its thread (Python-frame slices, "$...", and timed calls left
    out), each name's own time: its duration less that of the slices nested in it."""
    start, end = call["ts"], call["ts"] + call["dur"]
    nested = sorted((e for e in host if e is not call and e["pid"] == call["pid"] and e.get("tid") == call.get("tid")
                     and start <= e["ts"] and e["ts"] + e["dur"] <= end and not e["name"].startswith("$")
                     and not e["name"].startswith(LABEL_PREFIXES)), key=lambda e: (e["ts"], -e["dur"]))
    own = collections.Counter()
    stack: list[dict] = []
    for e in nested:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        if stack:
            own[stack[-1]["name"]] -= e["dur"]
        own[e["name"]] += e["dur"]
        stack.append(e)
    return own


def report(events: list[dict], min_ms: float, top: int) -> str:
    slow = [e for e in events if e["name"].startswith(LABEL_PREFIXES) and e["dur"] >= 1e3 * min_ms]
    slow.sort(key=lambda e: -e["dur"])
    device = [e for e in events if is_device(e)]
    host = [e for e in events if not is_device(e)]
    lines = [f"{len(slow)} timed calls of at least {min_ms:g} ms; device events in the trace: {len(device)}"]
    for call in slow[:top]:
        start, end = call["ts"], call["ts"] + call["dur"]
        lines.append(f"\n{call['name']}: {call['dur'] / 1e3:.2f} ms")
        for name, dur in self_times(call, host).most_common(6):
            lines.append(f"  host   {dur / 1e3:8.2f} ms  {name[:100]}")
        overlap = collections.Counter()
        last_end = None
        for e in device:
            a, b = max(start, e["ts"]), min(end, e["ts"] + e["dur"])
            if b > a:
                overlap[(e["thread"], e["name"])] += b - a
                last_end = b if last_end is None else max(last_end, b)
        for (thread, name), dur in overlap.most_common(6):
            lines.append(f"  device {dur / 1e3:8.2f} ms  [{thread[:30]}] {name[:70]}")
        if last_end is not None:
            lines.append(f"  the device's last work in the window ended {(end - last_end) / 1e3:.2f} ms before the "
                         f"call returned")
    per_label = collections.defaultdict(list)
    for e in slow:
        per_label[e["name"]].append(e["dur"])
    lines.append("\nslow calls per label: " + ", ".join(
        f"{name} {len(durs)} ({sum(durs) / 1e6:.2f} s)" for name, durs in sorted(per_label.items(),
                                                                                   key=lambda item: -sum(item[1]))))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--min-ms", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    print(report(load(args.directory), args.min_ms, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
