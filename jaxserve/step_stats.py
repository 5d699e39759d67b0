"""Per-step timings of the engine loop (host-only; no JAX), for `jaxserve bench` and metrics.

    engine.add_observer(StepStatsRecorder()) -> recorder.records: deque[StepStats] (bounded)
    (Engine(config, record_step_stats=True) does that; engine.step_stats is then its records)

An observer is any object with the two callbacks of `StepObserver`, which the engine loop calls
for each step that dispatched device work: `on_dispatch` right after the dispatch, `on_processed`
once that step's tokens have been read back and turned into outputs.

All times are `time.perf_counter()` seconds. A step's device work starts at
max(dispatch_t, previous step's done_t) and ends at done_t, so the device is idle between steps
for max(0, dispatch_t[k] - done_t[k-1]); `done_t` is taken by a watcher thread that blocks on the
step's sampled tokens, so it is the device's completion time (within thread wake-up latency), not
the moment the engine loop got round to reading the result.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import weakref
from typing import Any, Protocol


@dataclasses.dataclass(slots=True)
class StepStats:
    step: int
    num_tokens: int  # tokens scheduled (prefill chunks + decode rows)
    num_reqs: int  # requests scheduled
    num_prefill_tokens: int  # tokens of rows that are not single decode tokens
    t_start: float  # the step began (before schedule())
    schedule_s: float  # Scheduler.schedule()
    prepare_s: float  # runner host work up to the dispatch (ModelBatch, sampling metadata)
    dispatch_t: float  # the device work was enqueued
    readback_s: float = 0.0  # the engine loop blocked waiting for this step's results
    update_s: float = 0.0  # scheduler update + output processing of this step's results
    done_t: float = 0.0  # the device finished this step (watcher thread)
    t_end: float = 0.0  # this step's results were fully processed


def device_idle_share(stats: list[StepStats]) -> float:
    """Share of the wall time from the first dispatch to the last completion with no step on the device."""
    stats = [s for s in stats if s.done_t > 0]
    if len(stats) < 2:
        return 0.0
    idle = sum(max(0.0, cur.dispatch_t - prev.done_t) for prev, cur in zip(stats, stats[1:]))
    wall = stats[-1].done_t - stats[0].dispatch_t
    return idle / wall if wall > 0 else 0.0


class StepObserver(Protocol):
    def on_dispatch(self, out: Any, handle: Any, t_start: float, t_scheduled: float) -> None:
        """Step `out` (a SchedulerOutput) was dispatched; `handle.ready` is a device array ready once the
        device finished it. t_start: the step began; t_scheduled: scheduling ended (perf_counter)."""

    def on_processed(self, out: Any, t_collect: float, t_collected: float) -> None:
        """Step `out`'s results were processed; the engine waited for them from t_collect to t_collected."""


class StepStatsRecorder:
    """A StepObserver that keeps a StepStats per step (the last `maxlen`); a watcher thread stamps each
    step's device completion (StepStats.done_t)."""

    def __init__(self, maxlen: int = 100_000):
        self.records: collections.deque[StepStats] = collections.deque(maxlen=maxlen)
        self._by_step: dict[int, StepStats] = {}
        self._watch_queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_watch_device, args=(self._watch_queue,), name="jaxserve-step-watcher",
                         daemon=True).start()
        weakref.finalize(self, self._watch_queue.put, None)  # (the thread holds the queue, not self)

    def clear(self) -> None:
        self.records.clear()

    def on_dispatch(self, out, handle, t_start: float, t_scheduled: float) -> None:
        now = time.perf_counter()
        stats = StepStats(out.step, out.num_scheduled_tokens, len(out.decode_rows) + len(out.scheduled),
                          out.num_scheduled_tokens - len(out.decode_rows), t_start, t_scheduled - t_start,
                          now - t_scheduled, now)
        self.records.append(stats)
        self._by_step[out.step] = stats
        self._watch_queue.put((stats, handle.ready))

    def on_processed(self, out, t_collect: float, t_collected: float) -> None:
        stats = self._by_step.pop(out.step, None)
        if stats is None:  # dispatched before this recorder was attached
            return
        stats.readback_s = t_collected - t_collect
        stats.t_end = time.perf_counter()
        stats.update_s = stats.t_end - t_collected


def _watch_device(watch_queue: queue.SimpleQueue) -> None:
    """Stamps each dispatched step's device completion (StepStats.done_t), until None."""
    while (item := watch_queue.get()) is not None:
        stats, ready = item
        ready.block_until_ready()
        stats.done_t = time.perf_counter()
