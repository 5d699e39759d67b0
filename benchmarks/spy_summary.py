"""Where one thread's py-spy samples are: a raw py-spy file (`py-spy record --format raw --threads`, with or
without --native) summed per (innermost Python frame, the innermost DEPTH native frames with a symbol
below it), over all of the thread's samples and over those under each --under frame.

    python3 benchmarks/spy_summary.py spy.txt [--thread jaxserve-engine] [--under scatter_piece ...] [--top 12]
        [--depth 3] [--states]

--states (needs --native samples) first sorts the thread's samples by what the thread was doing:
  idle            in a Python threading wait (the engine thread's wait for work)
  GIL             back from a C call that released the GIL, waiting to take it again (a condition wait
                  right below a C function: CPython's take_gil is not symbolized)
  input event     an executable's launch waiting until an input buffer's event is recorded (the launch of
                  the program that produces it has not reached the stream yet)
  device          waiting for a device result (a readback, block_until_ready, a runtime mutex)
  running         anything else: Python or native code on the CPU
"""

from __future__ import annotations

import argparse
import collections
import re

_LINE = re.compile(r"^thread \((\d+)\)(?::\s*([^;]*))?;(.*)\s(\d+)$")


def samples(path: str, thread: str):
    """(frames outermost first, count) of each line of the thread named `thread`."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            match = _LINE.match(line.rstrip("\n"))
            if match and (match.group(2) or "").strip() == thread:
                yield match.group(3).split(";"), int(match.group(4))


def where(frames: list[str], depth: int) -> tuple[str, str]:
    """(the innermost Python frame, its innermost `depth` native frames with a symbol, innermost first)."""
    python = next((f for f in reversed(frames) if ".py:" in f), "-")
    below = frames[frames.index(python) + 1:] if python != "-" else frames
    named = [f.split(" (")[0] for f in reversed(below) if not f.startswith("0x") and ".py:" not in f]
    return python, " < ".join(named[:depth]) or "-"


_PYTHON_WAITS = ("Condition.wait", "Event.wait", "Queue.get", "Thread.join")


def state(frames: list[str]) -> str:
    """What a sample's thread was doing (--states)."""
    named = [f.split(" (")[0] for f in frames if not f.startswith("0x")]
    python = [f for f in frames if ".py:" in f]
    innermost = named[-1] if named else ""
    if python and any(python[-1].startswith(w) for w in _PYTHON_WAITS):
        return "idle"
    if any("WaitForEventOnStream" in f for f in named):
        return "input event"
    if innermost.startswith("pthread_cond_timedwait") and len(named) > 1 and ".py:" not in frames[-2]:
        return "GIL"
    if any(f in ("BlockUntilReady", "tsl::BlockUntilReady") or "Mutex::Block" in f or "FutexWaiter" in f
           for f in named[-6:]):
        return "device"
    return "running"


def states(title: str, rows: list[tuple[list[str], int]]) -> None:
    total = sum(count for _, count in rows)
    print(f"== {title}, by state: {total} samples")
    counts = collections.Counter()
    for frames, count in rows:
        counts[state(frames)] += count
    for name, count in counts.most_common():
        print(f"{count:6d} {100 * count / max(total, 1):5.1f}%  {name}")


def table(title: str, rows: list[tuple[list[str], int]], top: int, depth: int) -> None:
    total = sum(count for _, count in rows)
    print(f"== {title}: {total} samples")
    counts = collections.Counter()
    for frames, count in rows:
        counts[where(frames, depth)] += count
    for (python, native), count in counts.most_common(top):
        print(f"{count:6d} {100 * count / max(total, 1):5.1f}%  {python}  <-  {native}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--thread", default="jaxserve-engine")
    parser.add_argument("--under", action="append", default=[], help="a frame's text (a substring)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--depth", type=int, default=3, help="native frames shown per row")
    parser.add_argument("--states", action="store_true", help="first the samples by state (idle, GIL, ...)")
    args = parser.parse_args()
    rows = list(samples(args.path, args.thread))
    groups = [(f"thread {args.thread}", rows)]
    groups += [(f"under {frame}", [(f, c) for f, c in rows if any(frame in x for x in f)]) for frame in args.under]
    if args.states:
        for title, group in groups:
            states(title, group)
    for title, group in groups:
        table(title, group, args.top, args.depth)


if __name__ == "__main__":
    main()
