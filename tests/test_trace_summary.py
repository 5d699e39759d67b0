"""tools/trace_summary.py on a small synthetic perfetto trace: per-step busy time by kernel kind and
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
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "trace_summary.py"), str(path), "--steps", "3",
                          "--by-kernel"], capture_output=True, text=True, check=True).stdout
    assert "busy 0.016 ms/step (3 kernels)" in out and "gemm=0.010" in out and "all_reduce=0.006" in out
    assert "one step on GPU 0 (3 kernels, busy 16 us)" in out
    assert "6.0 us     2x    3.00  one_shot_all_reduce_kernel" in out
    assert "10.0 us     1x   10.00  gemm_fusion_dot_1" in out


def test_trace_summary_gaps(tmp_path):
    """--gaps: idle gaps of >= 2 us on each GPU (with their neighbours), and the all-reduce start skew."""
    meta, kernels = [], []
    for pid, shift in ((1, 0.0), (2, 0.5)):  # GPU 1 starts every kernel 0.5 us after GPU 0
        meta += [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"/device:GPU:{pid - 1}"}},
                 {"ph": "M", "name": "thread_name", "pid": pid, "tid": 7, "args": {"name": "Stream #7(Compute)"}}]
        ts = shift
        for step in range(2):  # a GEMM, an all-reduce 1 us later, then 5 us idle before the next step
            kernels.append({"ph": "X", "pid": pid, "tid": 7, "name": "gemm_fusion_dot_1", "ts": ts, "dur": 10.0})
            kernels.append({"ph": "X", "pid": pid, "tid": 7, "name": "one_shot_all_reduce_kernel",
                            "ts": ts + 11.0, "dur": 4.0 - shift})
            ts += 20.0
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + kernels}, f)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "trace_summary.py"), str(path), "--steps", "2",
                          "--gaps"], capture_output=True, text=True, check=True).stdout
    # span 35 us (or 34.5 on GPU 1) over 2 steps; one 5 us gap (the 1 us ones are under the threshold)
    assert "/device:GPU:0: span 0.018 ms/step, gaps >= 2 us: 0.5 per step, 2.5 us per step" in out
    assert "5.0 us after one_shot_all_reduce_kernel" in out
    assert "all-reduce kernels (2): start of /device:GPU:1 minus /device:GPU:0: median 0.5 us" in out
    assert "|duration difference| median 0.5 us, total 0.5 us per step" in out
