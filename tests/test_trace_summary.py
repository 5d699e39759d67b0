"""scripts/trace_summary.py on a small synthetic perfetto trace: per-step busy time by kernel kind and
one step's kernels by name."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

from tests.conftest import ROOT


def test_trace_summary_by_kernel(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}}]
    kernels, ts = [], 0.0
    for step in range(3):  # each step: a GEMM of 10 us and two all-reduces of 2 and 4 us
        for name, dur in (("gemm_fusion_dot_1", 10.0), ("one_shot_all_reduce_kernel", 2.0),
                          ("one_shot_all_reduce_kernel", 4.0)):
            kernels.append({"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": ts, "dur": dur})
            ts += dur + 1
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + kernels}, f)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_summary.py"), str(path), "--steps", "3",
                          "--by-kernel"], capture_output=True, text=True, check=True).stdout
    assert "busy 0.016 ms/step (3 kernels)" in out and "gemm=0.010" in out and "all_reduce=0.006" in out
    assert "one step on GPU 0 (3 kernels, busy 16 us)" in out
    assert "6.0 us     2x    3.00  one_shot_all_reduce_kernel" in out
    assert "10.0 us     1x   10.00  gemm_fusion_dot_1" in out
