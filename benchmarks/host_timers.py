"""Host time per engine function: runs a `jaxserve` command with timers around the scheduler's, the KV cache
manager's and the KV tiers' functions, the runner's dispatch, forward call and collect, every compiled
program's call and Python's garbage collections (`gc collection genN`, on any thread), and prints each one's
total, call count and per-call milliseconds (mean, p50, p90, p99, max) at exit (stderr, `TIMING` lines,
largest first). Calls made while a bench builds its engine (precompile) are
not counted. A call with a long tail is one the engine thread waits in: with overlap scheduling the device
idles once the step in flight ends while the thread is held.

    python3 benchmarks/host_timers.py bench multi-turn --config configs/llama3-8b-dummy.yaml ... --host-kv-gib 32

HOST_TIMERS_TRACE=DIR also writes a `jax.profiler` trace (Perfetto JSON under DIR) of engine steps
HOST_TIMERS_TRACE_STEPS (default 200:300, counted from the engine's build), each timed call a named slice
on the engine thread; `benchmarks/trace_waits.py DIR` says what the device ran while the slow ones waited.

Compiled programs are told apart by their number of argument leaves (`Compiled.__call__ leaves~N`): a KV
tier move of n blocks takes the caches' arrays, two index arrays and, for a load, n host rows. Only the
calling thread's time is counted where the engine loop makes the call. The timers add a few microseconds a
call.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import os
import runpy
import sys
import time

import jax
import numpy as np

from jaxserve.bench import common
from jaxserve.core import kv_cache_manager, scheduler
from jaxserve.core.kv_tiers import link
from jaxserve.runner import kv_transfer, model_runner

SECONDS: collections.defaultdict[str, list[float]] = collections.defaultdict(list)  # label -> each call's
TRACE_DIR = os.environ.get("HOST_TIMERS_TRACE")
TRACE_STEPS = tuple(int(n) for n in os.environ.get("HOST_TIMERS_TRACE_STEPS", "200:300").split(":"))
_steps = [-1]  # engine steps since the engine was built (-1: not built yet)
_tracing = [False]


def _annotation(label: str):
    return jax.profiler.TraceAnnotation(label) if TRACE_DIR else contextlib.nullcontext()


def _timed(label: str, function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            with _annotation(label):
                return function(*args, **kwargs)
        finally:
            SECONDS[label].append(time.perf_counter() - started)
    return timed


def _trace_steps(step):
    """Engine.step, starting the trace at TRACE_STEPS[0] and stopping it at TRACE_STEPS[1]."""
    @functools.wraps(step)
    def traced(*args, **kwargs):
        if _steps[0] >= 0:
            _steps[0] += 1
            if _steps[0] == TRACE_STEPS[0]:
                options = jax.profiler.ProfileOptions()
                options.python_tracer_level = 0  # (the runtime's slices and the device's, not every Python call)
                jax.profiler.start_trace(TRACE_DIR, create_perfetto_trace=True, profiler_options=options)
                _tracing[0] = True
            elif _steps[0] == TRACE_STEPS[1]:
                _stop_trace()
        return step(*args, **kwargs)
    return traced


def _stop_trace() -> None:
    if _tracing[0]:
        _tracing[0] = False
        jax.profiler.stop_trace()
        print(f"TIMING trace of engine steps {TRACE_STEPS[0]}-{_steps[0]} written under {TRACE_DIR}",
              file=sys.stderr)


def _wrap(cls, name: str, label: str) -> None:
    setattr(cls, name, _timed(label, getattr(cls, name)))


def _time_collections() -> None:
    started = [0.0]

    def collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            SECONDS[f"gc collection gen{info['generation']}"].append(time.perf_counter() - started[0])
    gc.callbacks.append(collection)


def install() -> None:
    _time_collections()
    _wrap(scheduler.Scheduler, "schedule", "Scheduler.schedule")
    _wrap(scheduler.Scheduler, "update_from_output", "Scheduler.update_from_output")
    for name in ("dispatch", "_run_forward", "collect"):
        _wrap(model_runner.ModelRunner, name, f"ModelRunner.{name}")
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
            SECONDS[label].append(time.perf_counter() - started)
    jax.stages.Compiled.__call__ = compiled_call
    make_engine = common.make_engine

    def made(*args, **kwargs):
        out = make_engine(*args, **kwargs)
        SECONDS.clear()
        _steps[0] = 0
        return out
    common.make_engine = made
    if TRACE_DIR:
        from jaxserve.engine import Engine
        Engine.step = _trace_steps(Engine.step)


def report() -> None:
    _stop_trace()
    print(f"TIMING {'':40s} {'total ms':>10s} {'calls':>7s}  per call ms: {'mean':>7s} {'p50':>7s} {'p90':>7s} "
          f"{'p99':>7s} {'max':>7s}", file=sys.stderr)
    for label, seconds in sorted(SECONDS.items(), key=lambda item: -sum(item[1])):
        ms = 1e3 * np.asarray(seconds)
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        print(f"TIMING {label:40s} {ms.sum():10.1f} {len(ms):7d}               {ms.mean():7.2f} {p50:7.2f} "
              f"{p90:7.2f} {p99:7.2f} {ms.max():7.1f}", file=sys.stderr)


if __name__ == "__main__":
    install()
    atexit.register(report)
    sys.argv = ["jaxserve", *sys.argv[1:]]
    runpy.run_module("jaxserve.cli", run_name="__main__")
