"""The decode instance's step log behind GET /pd/info's "steps": which of the slowest steps came at or just
after a block install, or during a pull."""

from __future__ import annotations

import pytest

from jaxserve.pd.step_log import DecodeStepLog


def test_summary_of_the_slowest_steps():
    log = DecodeStepLog()
    ms = [1, 1, 1, 5, 1, 1, 1, 1, 1, 9]
    for i, step_ms in enumerate(ms):
        installs = 1 if i in (2, 8) else 0
        # each step 0.5 ms of the engine thread's CPU and 0.25 ms waiting for the device; the rest "other"
        log.add(step_ms / 1e3, {2: 0.003, 8: 0.001}.get(i, 0.0), installs, pulling=i == 9, cpu_seconds=0.0005,
                wait_seconds=0.00025)
    summary = log.summary(slow_share=0.2, after=2)
    assert summary["count"] == 10 and summary["slowest_steps"] == 2  # steps 9 (9 ms) and 3 (5 ms)
    assert summary["step_ms"]["max"] == pytest.approx(9.0) and summary["step_ms"]["p50"] == pytest.approx(1.0)
    assert summary["install_steps"] == 2
    assert summary["install_ms"]["mean"] == pytest.approx(2.0) and summary["install_ms"]["max"] == pytest.approx(3.0)
    assert summary["install_ms"]["p50"] == pytest.approx(2.0)  # the middle of 1 and 3 ms
    # at or up to two steps after an install: 2, 3, 4 and 8, 9
    assert summary["near_install"] == pytest.approx(0.5) and summary["slowest_near_install"] == 1.0
    assert summary["pulling"] == pytest.approx(0.1) and summary["slowest_pulling"] == 0.5
    assert log.summary(slow_share=0.2, after=0)["slowest_near_install"] == 0.0  # neither slow step installed
    split = summary["split_ms"]
    assert split["all"] == pytest.approx({"cpu": 0.5, "device_wait": 0.25, "other": 2.2 - 0.75})
    assert split["slowest"] == pytest.approx({"cpu": 0.5, "device_wait": 0.25, "other": 7.0 - 0.75})


def test_summary_without_steps_or_installs_and_the_bound():
    log = DecodeStepLog(maxlen=3)
    assert log.summary() == {"count": 0}
    for step_ms in (1, 2, 3, 4):
        log.add(step_ms / 1e3, 0.0, 0, False)
    summary = log.summary()
    assert summary["count"] == 3 and summary["install_ms"] is None and summary["slowest_steps"] == 1
    assert summary["step_ms"]["p50"] == pytest.approx(3.0)  # the oldest step left the log
