"""The table of benchmarks/devrun_tiers.sh: KV cache tiers' block copy bandwidth against plain pinned copies, the
two-turn workload with the host tier on against off, and swap against recompute preemption, as ratios within
one run.

    python3 benchmarks/tiers_summary.py WORK_DIR [--json summary.json]

WORK_DIR holds kv_tiers.json (benchmarks/kv_tiers.py --output-json; when the run did not finish, the lines
kv_tiers.log printed are read instead) and preempt_{recompute,swap,auto}.json (`jaxserve bench throughput
--output-json` under a small device pool with a host tier). A missing one is reported as not run.

    copy share     = kv_transfer's GB/s / a plain pinned copy's GB/s of the same bytes      target >= 0.7
    turn-2 TTFT    = p50 TTFT of the returning turns, host tier on / off                    target <= 0.3
    throughput     = total tokens/s of both turns, on / off                                 target >= 1.5
    preemption     = elapsed s of each mode; auto (the cost model's choice) against the slower and the faster
                     fixed mode: target auto <= 1.05 x the faster

    python3 benchmarks/tiers_summary.py WORK_DIR --multi-turn [--json summary.json]

instead reads mt_t{T}_{off,on}[_TREE].json (`jaxserve bench multi-turn --output-json` at T turns, host tier
off / on; devrun_tiers.sh multiturn, and multiturn_ab's trees) and gives per T the returning turns' TTFT p50 and
the total tokens/s, each on run / the off run, with each turn's seconds, mean schedule ms per step (the tier
moves' dispatch included) and device idle share.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

COPY_LINE = re.compile(r"^(?P<direction>device_to_host|host_to_device): (?P<gb>[\d.]+) GB/s, (?P<blocks>\d+) blocks/s"
                       r".*?(?:, (?P<share>\d+)% of a plain pinned copy)?$")
PLAIN_LINE = re.compile(r"^plain copies, GB/s: (?P<items>.*)$")
TURNS_LINE = re.compile(r"^(?P<name>host_tier_o(?:n|ff)): turn-2 TTFT p50 (?P<p50>[\d.]+) ms p90 (?P<p90>[\d.]+) ms, "
                        r"(?P<tps>[\d.]+) tokens/s, turn-2 prefix hit rate (?P<hit>[\d.]+)% "
                        r"\(host (?P<host>\d+) tokens\)")
MODES = ("recompute", "swap", "auto")
COPY_TARGET, TTFT_TARGET, TPUT_TARGET, AUTO_SLACK = 0.7, 0.3, 1.5, 1.05


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def tiers_from_log(log: Path) -> dict:
    """kv_tiers.py's printed lines -> the parts of its report they carry (a run cut short has no JSON)."""
    report: dict = {"from_log": True}
    if not log.exists():
        return {}
    for line in log.read_text().splitlines():
        if m := COPY_LINE.match(line):
            item = {"gb_per_s": float(m["gb"]), "blocks_per_s": float(m["blocks"])}
            if m["share"]:
                item["share_of_pinned_copy"] = float(m["share"]) / 100
            report.setdefault("copy", {"plain_gb_per_s": {}})[m["direction"]] = item
        elif (m := PLAIN_LINE.match(line)) and "copy" in report:
            for part in m["items"].split(", "):
                name, value = part.rsplit(" ", 1)
                report["copy"]["plain_gb_per_s"][name] = float(value)
        elif m := TURNS_LINE.match(line):
            report.setdefault("turns", {})[m["name"]] = {
                "turn2_ttft_ms": {"p50": float(m["p50"]), "p90": float(m["p90"])},
                "total_tokens_per_s": float(m["tps"]), "turn2_hit_rate": float(m["hit"]) / 100,
                "turn2_host_hits": int(m["host"])}
    return report if len(report) > 1 else {}


def load_tiers(work: Path) -> dict:
    path = work / "kv_tiers.json"
    return json.loads(path.read_text()) if path.exists() else tiers_from_log(work / "kv_tiers.log")


def preempt_row(path: Path) -> dict | None:
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    engine, kv = report["engine"], report["engine"].get("kv_cache", {})
    return {"elapsed_s": report["elapsed_s"], "output_tokens_per_s": report["output_tokens_per_s"],
            "num_requests": report["num_requests"], "num_preemptions": engine.get("num_preemptions"),
            "swaps_out": kv.get("swaps_out"), "swaps_in": kv.get("swaps_in"), "num_kv_blocks": engine["num_kv_blocks"],
            "ttft_p50_ms": (report.get("ttft_ms") or {}).get("p50")}


def summarise(work: Path) -> dict:
    tiers = load_tiers(work)
    copy = tiers.get("copy")
    if copy is not None:
        copy = {**copy, "target": COPY_TARGET}
    turns = tiers.get("turns", {})
    on, off = turns.get("host_tier_on"), turns.get("host_tier_off")
    turn_ratios = {"turn2_ttft_p50_on_over_off": ratio(on and on["turn2_ttft_ms"]["p50"],
                                                       off and off["turn2_ttft_ms"]["p50"]),
                   "throughput_on_over_off": ratio(on and on["total_tokens_per_s"], off and off["total_tokens_per_s"])}
    modes = {mode: preempt_row(work / f"preempt_{mode}.json") for mode in MODES}
    fixed = [modes[m]["elapsed_s"] for m in ("recompute", "swap") if modes[m] is not None]
    auto = modes["auto"] and modes["auto"]["elapsed_s"]
    preempt = {"modes": modes, "swap_over_recompute": ratio(modes["swap"] and modes["swap"]["elapsed_s"],
                                                             modes["recompute"] and modes["recompute"]["elapsed_s"]),
               "auto_over_faster": ratio(auto, min(fixed)) if len(fixed) == 2 else None,
               "auto_over_slower": ratio(auto, max(fixed)) if len(fixed) == 2 else None}
    return {"copy": copy, "turns": {"host_tier_off": off, "host_tier_on": on, **turn_ratios,
                                    "from_log": bool(tiers.get("from_log")),
                                    "working_set_blocks": tiers.get("working_set_blocks")},
            "preemption": preempt}


MT_FILE = re.compile(r"^mt_t(?P<turns>\d+)_(?P<tier>on|off)(?:_(?P<tree>[A-Za-z0-9]+))?\.json$")


def _mt_row(report: dict) -> dict:
    """One run's row; a closed-loop run (--max-concurrency) has one step report for the whole run instead of
    one per turn, and its turn_s holds the run's seconds."""
    closed = report.get("max_concurrency") is not None
    steps = [report["steps"]] if closed else [t["steps"] for t in report["turns"]]
    return {"returning_ttft_p50_ms": (report.get("returning_ttft_ms") or {}).get("p50"),
            "total_tokens_per_s": report["total_tokens_per_s"], "elapsed_s": report["elapsed_s"],
            "max_concurrency": report.get("max_concurrency"),
            "turn_s": [report["elapsed_s"]] if closed else [t["elapsed_s"] for t in report["turns"]],
            "returning_hit_rate": report["returning_hit_rate"],
            "working_set_over_pool": report["working_set_over_pool"],
            "num_preemptions": report.get("num_preemptions"),
            "schedule_ms": [s["breakdown_ms"]["schedule"] for s in steps],
            "device_idle_share": [s["device_idle_share"] for s in steps]}


def multi_turn_rows(work: Path) -> dict[int, dict]:
    """mt_t{T}_{off,on}[_TREE].json -> {T: {"off": row, "on": {tree: row}}}, each on row with its ratios to the
    off row (TREE: the A/B's tree names, in the order they ran; "" for a plain run)."""
    rows: dict[int, dict] = {}
    for path in sorted(work.glob("mt_t*_o*.json"), key=lambda path: (path.stat().st_mtime, path.name)):
        if not (m := MT_FILE.match(path.name)):
            continue
        row = rows.setdefault(int(m["turns"]), {"off": None, "on": {}})
        report = _mt_row(json.loads(path.read_text()))
        if m["tier"] == "off":
            row["off"] = report
        else:
            row["on"][m["tree"] or ""] = report
    for row in rows.values():
        off = row["off"]
        for on in row["on"].values():
            on["ttft_on_over_off"] = ratio(on["returning_ttft_p50_ms"], off and off["returning_ttft_p50_ms"])
            on["throughput_on_over_off"] = ratio(on["total_tokens_per_s"], off and off["total_tokens_per_s"])
    return dict(sorted(rows.items()))


def render_multi_turn(rows: dict[int, dict]) -> str:
    lines = ["=== jaxserve bench multi-turn: host tier on vs off",
             f"{'turns':>5s} {'tier':20s} {'ret. TTFT p50':>13s} {'tokens/s':>9s} {'ret. hits':>9s} {'ws/pool':>7s} "
             f"{'preempt':>7s}  seconds per turn (schedule ms per step, device idle)"]
    if not rows:
        return "\n".join(lines + ["(not run)"])

    def line(turns: int, tier: str, r: dict) -> str:
        hits = r["returning_hit_rate"]
        per_turn = " + ".join(f"{t:.2f} ({s:.1f}, {100 * i:.0f}%)" for t, s, i in
                              zip(r["turn_s"], r["schedule_ms"], r["device_idle_share"]))
        if r.get("max_concurrency") is not None:
            per_turn += f" in all (closed loop, {r['max_concurrency']} in the engine)"
        return (f"{turns:5d} {tier:20s} {_f(r['returning_ttft_p50_ms'], '.1f'):>10s} ms {r['total_tokens_per_s']:9.0f} "
                f"{_f(hits and 100 * hits, '.1f'):>8s}% {r['working_set_over_pool']:7.2f} "
                f"{_f(r['num_preemptions'], 'd'):>7s}  {per_turn}")

    for turns, row in rows.items():
        lines.append(line(turns, "off", row["off"]) if row["off"] else f"{turns:5d} {'off':20s} (not run)")
        labels = {tree: f"on {tree}".strip() for tree in row["on"]}
        for tree, r in row["on"].items():
            lines.append(line(turns, labels[tree], r))
        for tree, r in row["on"].items():
            ttft, tput = r["ttft_on_over_off"], r["throughput_on_over_off"]
            lines.append(f"{turns:5d} {labels[tree]} / off: returning TTFT {_f(ttft)}x (target <= {TTFT_TARGET}: "
                         f"{_met(ttft, TTFT_TARGET, False)}), throughput {_f(tput)}x (target >= {TPUT_TARGET}: "
                         f"{_met(tput, TPUT_TARGET, True)})")
    return "\n".join(lines)


def _f(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _met(value, target: float, at_least: bool) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if at_least else value <= target) else "missed"


def render(summary: dict) -> str:
    lines = ["=== device <-> host block copies (kv_transfer's save / load paths) against plain copies of the same "
             "bytes"]
    copy = summary["copy"]
    if copy is None:
        lines.append("(not run)")
    else:
        for direction in ("device_to_host", "host_to_device"):
            item = copy.get(direction)
            if item is None:
                lines.append(f"{direction:15s} (not run)")
                continue
            share = item.get("share_of_pinned_copy")
            lines.append(f"{direction:15s} {item['gb_per_s']:8.2f} GB/s {item['blocks_per_s']:10.0f} blocks/s  "
                         f"{_f(share and 100 * share, '.0f')}% of a pinned copy (target >= {100 * COPY_TARGET:.0f}%: "
                         f"{_met(share, COPY_TARGET, True)})")
        plain = copy.get("plain_gb_per_s", {})
        lines.append("plain copies, GB/s: " + (", ".join(f"{k} {v:.2f}" for k, v in plain.items()) or "n/a"))
    turns = summary["turns"]
    lines += ["", "=== two-turn conversations on a device pool a third of the working set: host tier on vs off"
              + (" (from the log: the run was cut short)" if turns["from_log"] else "")]
    for name in ("host_tier_off", "host_tier_on"):
        r = turns[name]
        if r is None:
            lines.append(f"{name:14s} (not run)")
            continue
        ttft = r["turn2_ttft_ms"]
        lines.append(f"{name:14s} turn-2 TTFT p50 {ttft['p50']:9.1f} ms  p90 {ttft['p90']:9.1f} ms  "
                     f"{r['total_tokens_per_s']:9.0f} tokens/s  turn-2 hits {100 * r['turn2_hit_rate']:5.1f}% "
                     f"(host {r['turn2_host_hits']} tokens)"
                     + (f"  turns {r['turn1_s']:.2f} s + {r['turn2_s']:.2f} s" if "turn1_s" in r else ""))
    ttft, tput = turns["turn2_ttft_p50_on_over_off"], turns["throughput_on_over_off"]
    lines.append(f"on / off: turn-2 TTFT {_f(ttft)}x (target <= {TTFT_TARGET}: {_met(ttft, TTFT_TARGET, False)}), "
                 f"throughput {_f(tput)}x (target >= {TPUT_TARGET}: {_met(tput, TPUT_TARGET, True)})")
    pre = summary["preemption"]
    lines += ["", "=== preemption under a small device pool (jaxserve bench throughput, host tier on)",
              f"{'mode':10s} {'elapsed s':>9s} {'out tok/s':>10s} {'preempted':>9s} {'swaps out/in':>12s} "
              f"{'TTFT p50 ms':>11s} {'KV blocks':>9s}"]
    for mode in MODES:
        r = pre["modes"][mode]
        if r is None:
            lines.append(f"{mode:10s} (not run)")
            continue
        lines.append(f"{mode:10s} {r['elapsed_s']:9.2f} {r['output_tokens_per_s']:10.1f} "
                     f"{_f(r['num_preemptions'], 'd'):>9s} "
                     f"{_f(r['swaps_out'], 'd'):>5s}/{_f(r['swaps_in'], 'd'):<6s} {_f(r['ttft_p50_ms'], '.1f'):>11s} "
                     f"{r['num_kv_blocks']:9d}")
    faster = pre["auto_over_faster"]
    lines.append(f"swap / recompute elapsed: {_f(pre['swap_over_recompute'])}x; auto / the faster fixed mode: "
                 f"{_f(faster)}x (target <= {AUTO_SLACK}: {_met(faster, AUTO_SLACK, False)}), / the slower: "
                 f"{_f(pre['auto_over_slower'])}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.add_argument("--multi-turn", action="store_true", help="the bench multi-turn runs (mt_t*_*.json) instead")
    args = parser.parse_args()
    if args.multi_turn:
        summary = {"multi_turn": multi_turn_rows(args.work)}
        print(render_multi_turn(summary["multi_turn"]))
    else:
        summary = summarise(args.work)
        print(render(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
