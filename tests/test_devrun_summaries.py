"""The devrun scripts' summarizers (benchmarks/fp8_summary.py, benchmarks/tiers_summary.py,
benchmarks/trace_waits.py, benchmarks/spy_summary.py): the compute bound's FLOP count on the Llama-3-8B
shape, the tiers table rebuilt from kv_tiers.py's printed lines, the multi-turn table's ratios of each A/B
tree to the one run with the tier off, a trace's slow call split into its slices' own time and the device's
work beside it, one thread's py-spy samples summed where they are, and the MoE table's expert-parallel
ratios."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT


def load(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_prefill_flops_of_the_llama3_8b_shape(monkeypatch):
    fp8_summary = load("fp8_summary", monkeypatch)
    hf = json.loads((ROOT / "configs" / "models" / "llama3-8b" / "config.json").read_text())
    flops = fp8_summary.prefill_flops(hf, 32768)
    decoder_params = 6_979_321_856  # 8.03B less the embedding, lm_head and norms
    assert flops["weight_flops"] == 2 * 32768 * decoder_params + 2 * 4096 * 128256
    assert flops["attention_flops"] == 4 * 32 * 32 * 128 * 32768 * 32769 / 2
    # ~0.75 s at 989 TFLOP/s, 38% of it attention at 32K tokens
    assert (flops["weight_flops"] + flops["attention_flops"]) / 989e12 == pytest.approx(0.747, abs=0.001)


def test_tiers_summary_reads_a_cut_short_log(tmp_path, monkeypatch):
    tiers_summary = load("tiers_summary", monkeypatch)
    (tmp_path / "kv_tiers.log").write_text(
        "device_to_host: 12.50 GB/s, 5952 blocks/s (512 blocks of 2.10 MB), 81% of a plain pinned copy\n"
        "host_to_device: 20.00 GB/s, 9524 blocks/s (512 blocks of 2.10 MB), 40% of a plain pinned copy\n"
        "plain copies, GB/s: host_to_device 9.00, device_to_host 8.00, pinned_to_device 50.00\n"
        "host_tier_off: turn-2 TTFT p50 800.0 ms p90 900.0 ms, 10000 tokens/s, turn-2 prefix hit rate 10.0% "
        "(host 0 tokens), 3 preemptions (100 device blocks, working set 300)\n"
        "host_tier_on: turn-2 TTFT p50 200.0 ms p90 250.0 ms, 16000 tokens/s, turn-2 prefix hit rate 90.0% "
        "(host 5000 tokens), 3 preemptions (100 device blocks, working set 300)\n")
    summary = tiers_summary.summarise(tmp_path)
    assert summary["copy"]["device_to_host"] == {"gb_per_s": 12.5, "blocks_per_s": 5952, "share_of_pinned_copy": 0.81}
    assert summary["copy"]["plain_gb_per_s"]["pinned_to_device"] == 50.0
    turns = summary["turns"]
    assert turns["from_log"] and turns["host_tier_on"]["turn2_host_hits"] == 5000
    assert turns["turn2_ttft_p50_on_over_off"] == 0.25 and turns["throughput_on_over_off"] == 1.6
    text = tiers_summary.render(summary)
    assert "81% of a pinned copy (target >= 70%: met)" in text and "40% of a pinned copy" in text
    assert "recompute  (not run)" in text


def _multi_turn_report(ttft_p50: float, tokens_per_s: float, turn_s: list[float]) -> dict:
    step = {"breakdown_ms": {"schedule": 0.5}, "device_idle_share": 0.1}
    return {"returning_ttft_ms": {"p50": ttft_p50}, "total_tokens_per_s": tokens_per_s, "elapsed_s": sum(turn_s),
            "returning_hit_rate": 0.5, "working_set_over_pool": 3.0, "num_preemptions": 2,
            "turns": [{"elapsed_s": s, "steps": step} for s in turn_s]}


def test_multi_turn_summary_compares_each_tree_with_the_off_run(tmp_path, monkeypatch):
    tiers_summary = load("tiers_summary", monkeypatch)
    reports = {"mt_t3_off.json": _multi_turn_report(2000.0, 10000.0, [5.0, 5.0, 6.0]),
               "mt_t3_on_tree.json": _multi_turn_report(1000.0, 15000.0, [5.0, 2.5, 3.0]),
               "mt_t3_on_bigmoves.json": _multi_turn_report(500.0, 20000.0, [5.0, 1.5, 1.5]),
               "mt_t2_on.json": _multi_turn_report(100.0, 1.0, [1.0, 1.0]),
               "mt_t3_on_bad-name.json": _multi_turn_report(1.0, 1.0, [1.0])}
    for name, report in reports.items():
        (tmp_path / name).write_text(json.dumps(report))
    rows = tiers_summary.multi_turn_rows(tmp_path)
    assert list(rows) == [2, 3] and set(rows[3]["on"]) == {"tree", "bigmoves"}
    assert rows[3]["on"]["tree"]["throughput_on_over_off"] == 1.5
    assert rows[3]["on"]["bigmoves"]["ttft_on_over_off"] == 0.25
    assert rows[2]["off"] is None and rows[2]["on"][""]["throughput_on_over_off"] is None
    text = tiers_summary.render_multi_turn(rows)
    assert "on tree / off: returning TTFT 0.50x (target <= 0.3: missed), throughput 1.50x (target >= 1.5: met)" in text
    assert "on bigmoves / off: returning TTFT 0.25x (target <= 0.3: met)" in text
    assert "2 off                  (not run)" in text and "not measured" in text



def test_multi_turn_summary_of_closed_loop_runs_has_one_step_report(tmp_path, monkeypatch):
    """A --max-concurrency run reports no per-turn seconds: its row shows the run's seconds and its one step
    report, and its ratios come out as for rounds."""
    tiers_summary = load("tiers_summary", monkeypatch)
    for name, ttft, tput, idle in (("off", 400.0, 10000.0, 0.05), ("on", 100.0, 16000.0, 0.2)):
        report = _multi_turn_report(ttft, tput, [9.0])
        report.update(max_concurrency=32, steps={"breakdown_ms": {"schedule": 1.5}, "device_idle_share": idle},
                      turns=[{"elapsed_s": None, "steps": None}] * 3)
        (tmp_path / f"mt_t3_{name}.json").write_text(json.dumps(report))
    rows = tiers_summary.multi_turn_rows(tmp_path)
    assert rows[3]["on"][""]["ttft_on_over_off"] == 0.25 and rows[3]["on"][""]["throughput_on_over_off"] == 1.6
    text = tiers_summary.render_multi_turn(rows)
    assert "9.00 (1.5, 20%) in all (closed loop, 32 in the engine)" in text
    assert "on / off: returning TTFT 0.25x (target <= 0.3: met), throughput 1.60x (target >= 1.5: met)" in text

def test_ttft_bound_takes_the_rates_measured_in_the_run(tmp_path, monkeypatch):
    fp8_summary = load("fp8_summary", monkeypatch)
    model = ROOT / "configs" / "models" / "llama3-8b"
    report = {"args": {"input_len": 32768}, "ttft_ms": {"p50": 1300.0, "max": 1400.0, "count": 3},
              "engine": {"config": {"model": {"path": str(model)}, "cache": {"kv_cache_dtype": None}},
                         "num_compiled": 0}}
    (tmp_path / "ttft_32k_flash.json").write_text(json.dumps(report))
    flops = fp8_summary.prefill_flops(json.loads((model / "config.json").read_text()), 32768)
    at_peak = fp8_summary.summarise(tmp_path)["e"]["ttft_32k_flash"]
    assert at_peak["bound_s"] == pytest.approx((flops["weight_flops"] + flops["attention_flops"]) / 989e12)
    (tmp_path / "prefill_rates.json").write_text(json.dumps({"matmul_tflops": 650.0, "attention_tflops": 500.0}))
    row = fp8_summary.summarise(tmp_path)["e"]["ttft_32k_flash"]
    bound = flops["weight_flops"] / 650e12 + flops["attention_flops"] / 500e12
    assert row["bound_s"] == pytest.approx(bound) and row["ttft_over_bound"] == pytest.approx(1.3 / bound)
    assert row["ttft_over_peak_bound"] == pytest.approx(at_peak["ttft_over_bound"])
    assert "measured (prefill_rates.json)" in fp8_summary.render(fp8_summary.summarise(tmp_path))


def test_trace_waits_splits_a_slow_call_into_its_slices_own_time_and_the_device_work_beside_it(monkeypatch, tmp_path):
    """A timed call of 50 ms holding an enqueue of 40 ms that holds a 30 ms wait: their own times 10 and
    30 ms; a kernel on a stream overlapping the call's last 25 ms and still running when it returned; a
    Python-frame slice, a slice on another thread and a call under --min-ms are left out."""
    import gzip

    trace_waits = load("trace_waits", monkeypatch)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}}]
    events = meta + [
        {"ph": "X", "pid": 1, "tid": 1, "name": "KVTransfer.run", "ts": 1000, "dur": 50_000},
        {"ph": "X", "pid": 1, "tid": 1, "name": "Execute", "ts": 2000, "dur": 40_000},
        {"ph": "X", "pid": 1, "tid": 1, "name": "WaitForEvent", "ts": 5000, "dur": 30_000},
        {"ph": "X", "pid": 1, "tid": 1, "name": "$kv_transfer.py:1 run", "ts": 1000, "dur": 49_000},
        {"ph": "X", "pid": 1, "tid": 2, "name": "Other", "ts": 3000, "dur": 10_000},
        {"ph": "X", "pid": 1, "tid": 1, "name": "ModelRunner.collect", "ts": 60_000, "dur": 1_000},
        {"ph": "X", "pid": 2, "tid": 7, "name": "fusion_1", "ts": 26_000, "dur": 30_000},
    ]
    directory = tmp_path / "plugins" / "profile" / "run"
    directory.mkdir(parents=True)
    with gzip.open(directory / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    loaded = trace_waits.load(str(tmp_path))
    call = next(e for e in loaded if e["name"] == "KVTransfer.run")
    host = [e for e in loaded if not trace_waits.is_device(e)]
    assert dict(trace_waits.self_times(call, host)) == {"Execute": 10_000, "WaitForEvent": 30_000}
    text = trace_waits.report(loaded, min_ms=10, top=4)
    assert "1 timed calls of at least 10 ms; device events in the trace: 1" in text
    assert "KVTransfer.run: 50.00 ms" in text and "ModelRunner.collect" not in text.split("slow calls")[0]
    assert "device    25.00 ms  [Stream #7] fusion_1" in text
    assert "ended 0.00 ms before the call returned" in text


def test_spy_summary_sums_one_threads_samples_by_python_frame_and_native_frames_below(tmp_path, monkeypatch, capsys):
    spy = load("spy_summary", monkeypatch)
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (11): jaxserve-engine;run (a.py:1);step (e.py:5);scatter_piece (t.py:9);Execute (libx.so);"
        "0x7f00 (libc.so.6);cuModuleLoadData (libcuda.so) 3\n"
        "thread (11): jaxserve-engine;run (a.py:1);step (e.py:5);scatter_piece (t.py:9);Execute (libx.so);"
        "cuModuleLoadData (libcuda.so) 2\n"
        "thread (11): jaxserve-engine;run (a.py:1);step (e.py:5);collect (r.py:7);syscall (libc.so.6) 5\n"
        "thread (12): Thread-1;run (a.py:1);scatter_piece (t.py:9);syscall (libc.so.6) 40\n"
        "not a sample line\n")
    monkeypatch.setattr(sys, "argv", ["spy_summary.py", str(raw), "--under", "scatter_piece", "--depth", "2"])
    spy.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== thread jaxserve-engine: 10 samples"
    assert out[1].split() == ["5", "50.0%", "scatter_piece", "(t.py:9)", "<-", "cuModuleLoadData", "<", "Execute"]
    assert out[2].split() == ["5", "50.0%", "collect", "(r.py:7)", "<-", "syscall"]
    assert out[3] == "== under scatter_piece: 5 samples"  # the other thread's samples are not counted
    assert out[4].split()[:3] == ["5", "100.0%", "scatter_piece"]


def test_spy_summary_states_tell_the_gil_from_waits_and_work(tmp_path, monkeypatch, capsys):
    """--states: a condition wait right below a C call is the GIL's re-take; a launch waiting for an input's
    event, a runtime mutex, a Python threading wait and plain work are told apart."""
    spy = load("spy_summary", monkeypatch)
    engine = "thread (11): jaxserve-engine;run (a.py:1);step (e.py:5);"
    raw = tmp_path / "spy.txt"
    raw.write_text(
        engine + "scatter (t.py:9);PjitFunction::Call (jaxlib.so);pthread_cond_timedwait (libc.so.6) 4\n"
        + engine + "scatter (t.py:9);Execute (x.so);xla::BufferSequencingEvent::WaitForEventOnStream (x.so);"
        "tsl::BlockUntilReady (x.so);absl::Mutex::Block (x.so);syscall (libc.so.6) 3\n"
        + engine + "collect (r.py:7);_value (array.py:637);absl::Mutex::Block (x.so);syscall (libc.so.6) 2\n"
        + engine + "Condition.wait (threading.py:355);PyThread_acquire_lock_timed (libpython.so) 6\n"
        + engine + "pack (p.py:3);array_concatenate (numpy.so) 5\n")
    monkeypatch.setattr(sys, "argv", ["spy_summary.py", str(raw), "--states", "--under", "scatter", "--top", "0"])
    spy.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== thread jaxserve-engine, by state: 20 samples"
    assert [line.split()[0::2] for line in out[1:6]] == [["6", "idle"], ["5", "running"], ["4", "GIL"],
                                                         ["3", "input"], ["2", "device"]]
    assert out[6] == "== under scatter, by state: 7 samples"
    assert [line.split()[2:] for line in out[7:9]] == [["GIL"], ["input", "event"]]


def test_moe_summary_compares_e2_with_e1_and_reports_the_rebalancer(tmp_path, monkeypatch, capsys):
    moe = load("moe_summary", monkeypatch)
    assert moe.expert_parallel(tmp_path) is None  # no expert-parallel run: no section
    steady = lambda rate: {"steps": {"steady_decode": {"tokens_per_s": rate}}}
    for name, report in {"moe_e1_b1": steady(100.0), "moe_e2_b1": steady(150.0), "moe_e2_b64": steady(900.0),
                         "moe_tput": {"output_tokens_per_s": 400.0, "total_tokens_per_s": 2000.0, "requests_per_s": 1.0,
                                      "elapsed_s": 10.0, "roofline_share": 0.5, "num_requests": 10,
                                      "steps": {"mean_decode_rows_per_step": 8.0}},
                         "moe_e2_tput": {"output_tokens_per_s": 500.0},
                         "eplb": {"before": {"tokens_per_s": 80.0, "max_over_mean_mean": 1.5, "max_over_mean_worst": 2.0},
                                  "after": {"tokens_per_s": 100.0, "max_over_mean_mean": 1.1, "max_over_mean_worst": 1.2},
                                  "speedup": 1.25, "rebalance_s": 0.5}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    ep = moe.expert_parallel(tmp_path)
    assert ep["b1"] == {"e1": 100.0, "e2": 150.0, "e2_over_e1": 1.5}
    assert ep["b64"] == {"e1": None, "e2": 900.0, "e2_over_e1": None}  # E=1 not run: no ratio
    assert ep["tput"] == {"e1": 400.0, "e2": 500.0, "e2_over_e1": 1.25}
    monkeypatch.setattr(sys, "argv", ["moe_summary.py", str(tmp_path)])
    moe.main()
    out = capsys.readouterr().out
    assert "b1         E=1     100.0  E=2     150.0  E=2 / E=1 1.50" in out
    assert "rebalancer after / before tok/s: 1.250 (rebalance 0.50 s)" in out
