"""Per-step timings of the engine loop (host-only; no JAX), for `jaxserve bench` and metrics.

    Engine(config, record_step_stats=True) -> engine.step_stats: deque[StepStats] (bounded)

All times are `time.perf_counter()` seconds. A step's device work starts at
max(dispatch_t, previous step's done_t) and ends at done_t, so the device is idle between steps
for max(0, dispatch_t[k] - done_t[k-1]); `done_t` is taken by a watcher thread that blocks on the
step's sampled tokens, so it is the device's completion time (within thread wake-up latency), not
the moment the engine loop got round to reading the result.
"""

from __future__ import annotations

import dataclasses


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
