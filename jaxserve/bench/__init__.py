"""`jaxserve bench {throughput,latency,serve,multi-turn}` (vLLM's `bench` conventions).

Each mode is a module here with `main(argv) -> int`; this dispatcher only picks the module, so a mode's
imports (JAX for the offline modes, an HTTP client for `serve`) load only when it runs.
"""

from __future__ import annotations

import importlib
import sys

MODES = {
    "throughput": ("jaxserve.bench.throughput", "offline throughput: N prompts through LLM.generate"),
    "latency": ("jaxserve.bench.latency", "latency of one batch of B requests with fixed lengths"),
    "serve": ("jaxserve.bench.serve", "online: an async client against a running `jaxserve serve`"),
    "multi-turn": ("jaxserve.bench.multi_turn", "multi-turn chat: C conversations, each turn appends to its history"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES:
        lines = "\n".join(f"  {name:11s} {help_}" for name, (_, help_) in MODES.items())
        print(f"usage: jaxserve bench {{{','.join(MODES)}}} [options]\n{lines}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(MODES[argv[0]][0]).main(argv[1:])
