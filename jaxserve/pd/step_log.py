"""A decode instance's step log (GET /pd/info's "steps"): what its slowest steps have in common."""

from __future__ import annotations

import collections

import numpy as np

STEP_RECORDS = 100_000  # the decode steps /pd/info summarises (the latest)


class DecodeStepLog:
    """A decode instance's latest steps, for GET /pd/info: each step's seconds (its commands, the block
    installs among them, and its engine step; idle steps are not logged, their installs count in the next
    logged step), the engine thread's seconds dispatching its installs, whether a pull of blocks from a
    prefill instance was in flight during it, and how the step's seconds split: the engine thread's CPU time,
    its wait for the device's results, and the rest (the thread neither ran nor waited for the device:
    waiting for the GIL, or blocked in a call). summary() says whether the slowest steps are those at
    or just after an install (an install's scatter runs on the device before the next step's forward, and
    with overlap a step's wait shows in the step after it) or during a pull, and how their seconds split."""

    def __init__(self, maxlen: int = STEP_RECORDS):
        self.records: collections.deque[tuple[float, float, int, bool, float, float]] = collections.deque(
            maxlen=maxlen)

    def add(self, seconds: float, install_seconds: float, installs: int, pulling: bool, cpu_seconds: float = 0.0,
            wait_seconds: float = 0.0) -> None:
        self.records.append((seconds, install_seconds, installs, pulling, cpu_seconds, wait_seconds))

    def summary(self, slow_share: float = 0.01, after: int = 2) -> dict:
        """{"count", "step_ms" (p50, p90, p99, max), "install_steps", "install_ms" (mean, p50, p90, p99, max of
        the steps with installs) and, over the slowest `slow_share` of the steps (at least one), the share at
        an install or up to `after` steps after one ("slowest_near_install") and during a pull
        ("slowest_pulling"), beside the same shares over every step ("near_install", "pulling"); "split_ms":
        the mean "cpu", "device_wait" and "other" milliseconds of every step ("all") and of the slowest}."""
        if not self.records:
            return {"count": 0}
        records = np.asarray(self.records, np.float64)  # (a copy: the engine thread keeps appending)
        seconds, install_s, installed, pulling = records[:, 0], records[:, 1], records[:, 2] > 0, records[:, 3] > 0
        cpu, wait = records[:, 4], records[:, 5]
        other = np.maximum(0.0, seconds - cpu - wait)
        near = installed.copy()
        for shift in range(1, after + 1):
            near[shift:] |= installed[:-shift]
        slowest = np.argsort(seconds, kind="stable")[-max(1, int(np.ceil(slow_share * len(records)))):]

        def split(rows) -> dict:
            return {name: float(1e3 * values[rows].mean())
                    for name, values in (("cpu", cpu), ("device_wait", wait), ("other", other))}

        return {"count": len(records),
                "step_ms": {f"p{q}": float(1e3 * np.percentile(seconds, q)) for q in (50, 90, 99)}
                | {"max": float(1e3 * seconds.max())},
                "install_steps": int(installed.sum()),
                "install_ms": {"mean": float(1e3 * install_s[installed].mean())}
                | {f"p{q}": float(1e3 * np.percentile(install_s[installed], q)) for q in (50, 90, 99)}
                | {"max": float(1e3 * install_s[installed].max())} if installed.any() else None,
                "slowest_steps": len(slowest),
                "slowest_near_install": float(near[slowest].mean()), "near_install": float(near.mean()),
                "slowest_pulling": float(pulling[slowest].mean()), "pulling": float(pulling.mean()),
                "split_ms": {"all": split(slice(None)), "slowest": split(slowest)}}


class DeviceWaits:
    """A StepObserver adding up the engine thread's waits for the device's results (Engine._process)."""

    def __init__(self):
        self.seconds = 0.0

    def on_dispatch(self, out, handle, t_start: float, t_scheduled: float) -> None:
        pass

    def on_processed(self, out, t_collect: float, t_collected: float) -> None:
        self.seconds += t_collected - t_collect
