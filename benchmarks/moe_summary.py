"""The table of benchmarks/devrun_moe.sh: the grouped GEMM against `lax.ragged_dot`, the MoE's decode
rates against its roofline, the MoE against its dense peer of equal active parameters, and (where the ep,
ep_tput or eplb modes ran) expert parallelism at E=2 against E=1 and the rebalancer's before and after.

    python3 benchmarks/moe_summary.py WORK_DIR [--tput-label TEXT] [--json summary.json]

WORK_DIR holds the run's logs and `--output-json` reports: {moe,dense}_{b1,b64,tput}.json,
moe_e{1,2}_{b1,b64}.json, moe_e2_tput.json, eplb.json (benchmarks/eplb_bench.py's) and gemm_*.log
(benchmarks/grouped_gemm.py's output). A missing one is reported as not run.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GEMM_LINE = re.compile(r"^(?P<proj>gate_up|down)\s+T=\s*(?P<tokens>\d+) rows=\s*(?P<rows>\d+) experts=\s*"
                       r"(?P<experts>\d+) (?P<name>.+?)\s+(?P<ms>[\d.]+) ms\s+(?P<tbs>[\d.]+) TB/s\s+(?P<tflops>[\d.]+) "
                       r"TFLOP/s x\s*(?P<ratio>[\d.]+) vs ragged_dot")
COPY_BW = 4.3  # TB/s, the H200's measured device-to-device copy bandwidth


def gemm_rows(work: Path) -> list[dict]:
    """Per (projection, tokens): ragged_dot, the fastest Pallas config and the dense einsum, if run."""
    by_shape: dict[tuple[str, int], dict] = {}
    for log in sorted(work.glob("gemm_*.log")):
        for line in log.read_text().splitlines():
            m = GEMM_LINE.match(line.strip())
            if not m:
                continue
            row = by_shape.setdefault((m["proj"], int(m["tokens"])), {"proj": m["proj"], "tokens": int(m["tokens"]),
                                                                      "rows": int(m["rows"]),
                                                                      "experts": int(m["experts"])})
            ms, name = float(m["ms"]), m["name"].strip()
            if name == "ragged_dot":
                row["ragged_dot_ms"] = ms
            elif name.startswith("pallas") and ms < row.get("pallas_ms", float("inf")):
                row |= {"pallas_ms": ms, "config": name[len("pallas "):], "touched_tb_s": float(m["tbs"]),
                        "tflop_s": float(m["tflops"])}
            elif name.startswith("dense"):
                row["dense_ms"] = ms
    return [by_shape[key] for key in sorted(by_shape)]


def load(work: Path, name: str) -> dict | None:
    path = work / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def latency_row(report: dict | None) -> dict | None:
    if report is None:
        return None
    roof, steady = report["roofline"], report["steps"]["steady_decode"]
    return {"decode_tokens_per_s": report["decode_tokens_per_s"], "steady_tokens_per_s": steady["tokens_per_s"],
            "roofline_tokens_per_s": roof["tokens_per_s"], "roofline_share": report["roofline_share"],
            "read_weight_gb": roof["read_weight_bytes"] / 1e9, "bytes_per_step_gb": roof["bytes_per_step"] / 1e9,
            "experts_touched_per_layer": roof.get("experts_touched_per_layer"),
            "touched_expert_gb": roof["touched_expert_bytes"] / 1e9 if "touched_expert_bytes" in roof else None,
            "tpot_ms": (report.get("tpot_ms") or {}).get("mean"), "latency_s": report["latency_ms"]["mean"] / 1e3,
            "num_compiled": report["engine"]["num_compiled"], "engine_init_s": report["engine"]["engine_init_s"]}


def throughput_row(report: dict | None) -> dict | None:
    if report is None:
        return None
    return {"output_tokens_per_s": report["output_tokens_per_s"], "total_tokens_per_s": report["total_tokens_per_s"],
            "requests_per_s": report["requests_per_s"], "elapsed_s": report["elapsed_s"],
            "roofline_share": report["roofline_share"], "num_requests": report["num_requests"],
            "mean_decode_rows": report["steps"]["mean_decode_rows_per_step"]}


def expert_parallel(work: Path) -> dict | None:
    """Steady decode tokens/s at E=1 and E=2 (batch 1, batch 64), throughput output tokens/s at E=1
    (moe_tput) and E=2, and the rebalancer's report; None when no expert-parallel run left a report."""
    def steady(name):
        report = load(work, name)
        return report and report["steps"]["steady_decode"]["tokens_per_s"]

    def output(name):
        report = load(work, name)
        return report and report["output_tokens_per_s"]

    rows = {name: {"e1": steady(f"moe_e1_{name}"), "e2": steady(f"moe_e2_{name}")} for name in ("b1", "b64")}
    rows["tput"] = {"e1": output("moe_tput"), "e2": output("moe_e2_tput")} if load(work, "moe_e2_tput") else None
    eplb = load(work, "eplb")
    if eplb is None and rows["tput"] is None and not any(r["e2"] for r in (rows["b1"], rows["b64"])):
        return None
    for row in rows.values():
        if row is not None:
            row["e2_over_e1"] = _ratio(row["e2"], row["e1"])
    return rows | {"eplb": eplb}


def _f(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--tput-label", default="", help="what the throughput run was, for the heading")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    summary: dict = {"gemm": gemm_rows(args.work)}
    for name in ("b1", "b64"):
        summary[name] = {model: latency_row(load(args.work, f"{model}_{name}")) for model in ("moe", "dense")}
    summary["tput"] = {model: throughput_row(load(args.work, f"{model}_tput")) for model in ("moe", "dense")}

    print("=== grouped GEMM (Qwen3-30B-A3B experts, bf16): fastest Pallas config vs lax.ragged_dot")
    print(f"{'proj':8s} {'T':>5s} {'rows':>6s} {'exp':>4s} {'ragged ms':>10s} {'pallas ms':>10s} {'x ragged':>8s} "
          f"{'TB/s':>6s} {'% 4.3':>6s} {'dense ms':>9s}  config")
    for r in summary["gemm"]:
        ratio = _ratio(r.get("ragged_dot_ms"), r.get("pallas_ms"))
        tbs = r.get("touched_tb_s")
        print(f"{r['proj']:8s} {r['tokens']:5d} {r['rows']:6d} {r['experts']:4d} {_f(r.get('ragged_dot_ms'), '.4f'):>10s} "
              f"{_f(r.get('pallas_ms'), '.4f'):>10s} {_f(ratio, '.2f'):>8s} {_f(tbs, '.2f'):>6s} "
              f"{_f(tbs and 100 * tbs / COPY_BW, '.0f'):>6s} {_f(r.get('dense_ms'), '.4f'):>9s}  {r.get('config', '')}")
    if not summary["gemm"]:
        print("(not run)")

    print("\n=== decode (jaxserve bench latency): steady decode tokens/s vs the roofline of the bytes read")
    print(f"{'run':10s} {'model':6s} {'tok/s':>8s} {'roofline':>9s} {'share':>6s} {'GB/step':>8s} {'experts':>8s} "
          f"{'TPOT ms':>8s} {'shapes':>6s} {'init s':>6s}")
    for name in ("b1", "b64"):
        for model in ("moe", "dense"):
            r = summary[name][model]
            if r is None:
                print(f"{name:10s} {model:6s} (not run)")
                continue
            print(f"{name:10s} {model:6s} {_f(r['steady_tokens_per_s']):>8s} {_f(r['roofline_tokens_per_s']):>9s} "
                  f"{_f(r['roofline_share'] and 100 * r['roofline_share'], '.0f'):>5s}% {r['bytes_per_step_gb']:8.2f} "
                  f"{_f(r['experts_touched_per_layer']):>8s} {_f(r['tpot_ms'], '.2f'):>8s} {r['num_compiled']:6d} "
                  f"{r['engine_init_s']:6.1f}")
        moe, dense = summary[name]["moe"], summary[name]["dense"]
        summary[name]["moe_over_dense"] = _ratio(moe and moe["steady_tokens_per_s"],
                                                 dense and dense["steady_tokens_per_s"])
        print(f"{name:10s} MoE / dense decode tokens/s: {_f(summary[name]['moe_over_dense'], '.2f')}")

    print(f"\n=== jaxserve bench throughput ({args.tput_label or 'as run'})")
    for model in ("moe", "dense"):
        r = summary["tput"][model]
        if r is None:
            print(f"{model:6s} (not run)")
            continue
        print(f"{model:6s} {r['output_tokens_per_s']:9.1f} output tok/s  {r['total_tokens_per_s']:9.1f} total tok/s  "
              f"{r['elapsed_s']:6.1f} s for {r['num_requests']} requests  roofline share "
              f"{_f(100 * r['roofline_share'], '.0f')}% at {_f(r['mean_decode_rows'])} decode rows")
    moe, dense = summary["tput"]["moe"], summary["tput"]["dense"]
    summary["tput"]["moe_over_dense"] = _ratio(moe and moe["output_tokens_per_s"], dense and dense["output_tokens_per_s"])
    print(f"MoE / dense output tokens/s: {_f(summary['tput']['moe_over_dense'], '.2f')}")

    summary["expert_parallel"] = ep = expert_parallel(args.work)
    if ep is not None:
        print("\n=== expert parallelism: E=2 against E=1 (the same MoE config), steady decode or output tok/s")
        for name in ("b1", "b64", "tput"):
            row = ep[name]
            if row is None:
                print(f"{name:10s} (not run)")
                continue
            print(f"{name:10s} E=1 {_f(row['e1']):>9s}  E=2 {_f(row['e2']):>9s}  E=2 / E=1 {_f(row['e2_over_e1'], '.2f')}")
        eplb = ep["eplb"]
        if eplb is None:
            print("rebalancer (not run)")
        else:
            for name in ("before", "after"):
                phase = eplb[name]
                print(f"rebalancer {name:6s} {phase['tokens_per_s']:9.1f} tok/s, device load max/mean per layer: "
                      f"mean {phase['max_over_mean_mean']:.3f}, worst {phase['max_over_mean_worst']:.3f}")
            print(f"rebalancer after / before tok/s: {eplb['speedup']:.3f} (rebalance {eplb['rebalance_s']:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
