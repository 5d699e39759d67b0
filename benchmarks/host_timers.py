"""Host time per engine function: runs a `jaxserve` command with timers around the scheduler's, the KV cache
manager's and the KV tiers' functions, the runner's dispatch and every compiled program's call, and prints
each one's total and call count at exit (stderr, `TIMING` lines, largest first).

    python3 benchmarks/host_timers.py bench multi-turn --config configs/llama3-8b-dummy.yaml ... --host-kv-gib 32

Compiled programs are told apart by their number of argument leaves (`Compiled.__call__ leaves~N`): a KV
tier move of n blocks takes the caches' arrays, two index arrays and, for a load, n host rows. Only the
calling thread's time is counted where the engine loop makes the call. The timers add a few microseconds a
call.
"""

from __future__ import annotations

import atexit
import collections
import functools
import runpy
import sys
import time

import jax

from jaxserve.core import kv_cache_manager, scheduler
from jaxserve.core.kv_tiers import link
from jaxserve.runner import kv_transfer, model_runner

TOTALS: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def _timed(label: str, function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - started
            CALLS[label] += 1
    return timed


def _wrap(cls, name: str, label: str) -> None:
    setattr(cls, name, _timed(label, getattr(cls, name)))


def install() -> None:
    _wrap(scheduler.Scheduler, "schedule", "Scheduler.schedule")
    _wrap(model_runner.ModelRunner, "dispatch", "ModelRunner.dispatch")
    for name in ("poll", "run", "_gathered"):
        _wrap(kv_transfer.KVTransfer, name, f"KVTransfer.{name}")
    for name in ("get_computed_blocks", "loading_prefix", "allocate_slots", "swap_ready", "swap_in"):
        _wrap(kv_cache_manager.KVCacheManager, name, f"KVCacheManager.{name}")
    for name, member in vars(link.TierLink).items():
        if callable(member) and not name.startswith("__"):
            _wrap(link.TierLink, name, f"TierLink.{name}")
    call = jax.stages.Compiled.__call__

    def compiled_call(self, *args, **kwargs):
        label = f"Compiled.__call__ leaves~{len(jax.tree.leaves(args))}"
        started = time.perf_counter()
        try:
            return call(self, *args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - started
            CALLS[label] += 1
    jax.stages.Compiled.__call__ = compiled_call


def report() -> None:
    for label, total in sorted(TOTALS.items(), key=lambda item: -item[1]):
        print(f"TIMING {label:40s} {1e3 * total:10.1f} ms {CALLS[label]:8d} calls "
              f"{1e6 * total / CALLS[label]:9.1f} us/call", file=sys.stderr)


if __name__ == "__main__":
    install()
    atexit.register(report)
    sys.argv = ["jaxserve", *sys.argv[1:]]
    runpy.run_module("jaxserve.cli", run_name="__main__")
