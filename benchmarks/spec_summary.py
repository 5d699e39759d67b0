"""The table of benchmarks/devrun_spec.sh: speculative decoding's cost and speed-up curve under the bench's
SYNTHETIC acceptance (outputs not meaningful), as ratios to speculation off in the same run.

    python3 benchmarks/spec_summary.py WORK_DIR [--json summary.json]

WORK_DIR holds `jaxserve bench latency --output-json` reports: plain_b{B}.json (speculation off) and
spec_b{B}.json (n-gram, synthetic acceptance swept in one engine: its `synthetic_sweep`), and optionally
spec_b{B}_sync.json (the same with overlap off), draft_b{B}.json (a draft model proposing, its guesses
accepted at the same synthetic rates) and draft_fp8_b{B}.json (the same draft quantized to FP8 at load). A
missing one is reported as not run.

    step ms       = TPOT x tokens per verified step (the mean accepted length; 1 with speculation off):
                    the time of one step as a request sees it, host work included
    step ratio    = step ms / plain step ms; at acceptance 0 the verify step's cost (issue target <= 1.1
                    at batch 1, k = 4); device ratio: the same for the mean device time per step
                    (common.step_report's breakdown, one prefill step per iteration included)
    host ms       = the host's dispatch of one step (the same breakdown's `prepare`: from the end of
                    scheduling until the step's programs are enqueued); near or above the step ms, the host
                    and not the device sets the pace
    speed-up      = decode tokens/s / plain decode tokens/s (target >= 2.5 at acceptance 0.8, batch 1)
    break-even    = the acceptance where the speed-up crosses 1, interpolated linearly between the swept
                    points (below it speculation costs more than it gains)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KINDS = {"spec": "ngram", "spec_sync": "ngram-sync", "draft": "draft", "draft_fp8": "draft-fp8"}  # kind -> label
NAME = re.compile(r"^(plain|spec|draft|draft_fp8)_b(\d+)(_sync)?\.json$")


def load_runs(work: Path) -> dict[tuple[str, int], dict]:
    """(kind, batch) -> report, kind plain | spec | spec_sync | draft | draft_fp8."""
    runs = {}
    for path in sorted(work.glob("*.json")):
        m = NAME.match(path.name)
        if m:
            runs[(m[1] + (m[3] or ""), int(m[2]))] = json.loads(path.read_text())
    return runs


def point(run: dict) -> dict:
    """One measured configuration's figures."""
    spec = run.get("spec_decode")
    tokens_per_step = (spec or {}).get("mean_accepted_length") or 1.0
    tpot = (run.get("tpot_ms") or {}).get("mean")
    return {"acceptance": spec["synthetic_acceptance"] if spec else None,
            "decode_tokens_per_s": run["decode_tokens_per_s"], "tpot_ms": tpot,
            "tokens_per_step": tokens_per_step, "step_ms": tpot * tokens_per_step if tpot else None,
            "expected_tokens_per_step": (spec or {}).get("expected_mean_accepted_length"),
            "device_ms": run["steps"]["breakdown_ms"]["device"],
            "host_ms": run["steps"]["breakdown_ms"]["prepare"]}


def sweep(run: dict) -> list[dict]:
    return [point(entry) for entry in run.get("synthetic_sweep", [run])]


def ratio(a, b):
    return a / b if a is not None and b else None


def break_even(points: list[dict]) -> float | None | str:
    """The acceptance where the speed-up crosses 1 (None: never measured both sides; 'always' / 'never')."""
    points = sorted((p for p in points if p["speedup"] is not None), key=lambda p: p["acceptance"])
    if not points:
        return None
    if points[0]["speedup"] >= 1.0:
        return "always"
    for low, high in zip(points, points[1:]):
        if low["speedup"] < 1.0 <= high["speedup"]:
            t = (1.0 - low["speedup"]) / (high["speedup"] - low["speedup"])
            return low["acceptance"] + t * (high["acceptance"] - low["acceptance"])
    return "never"


def summarise(work: Path) -> dict:
    runs = load_runs(work)
    batches = sorted({batch for _, batch in runs})
    table = {}
    for batch in batches:
        plain = runs.get(("plain", batch))
        base = point(plain) if plain is not None else None
        rows = {}
        for kind in KINDS:
            if (kind, batch) not in runs:
                continue
            points = sweep(runs[(kind, batch)])
            for p in points:
                p["speedup"] = ratio(p["decode_tokens_per_s"], base and base["decode_tokens_per_s"])
                p["step_ratio"] = ratio(p["step_ms"], base and base["step_ms"])
                p["device_ratio"] = ratio(p["device_ms"], base and base["device_ms"])
            rows[kind] = {"points": points, "break_even_acceptance": break_even(points)}
        table[batch] = {"plain": base, **rows}
    return table


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def lookup(table: dict, batch: int, acceptance: float, kind: str = "spec") -> dict | None:
    for p in table.get(batch, {}).get(kind, {}).get("points", []):
        if p["acceptance"] is not None and abs(p["acceptance"] - acceptance) < 1e-9:
            return p
    return None


def render(table: dict) -> str:
    lines = ["SYNTHETIC acceptance (the bench's --spec-synthetic-acceptance: outputs not meaningful); "
             "n-gram proposer unless named; ratios to speculation off in the same run", ""]
    verify, fast = lookup(table, 1, 0.0), lookup(table, 1, 0.8)
    lines.append(f"(a) verify step at batch 1 (acceptance 0, every guess scored): {fmt(verify and verify['step_ratio'])}x "
                 f"a plain decode step as a request sees it, {fmt(verify and verify['device_ratio'])}x its device "
                 f"time (target <= 1.1)")
    lines.append(f"(b) acceptance 0.8, batch 1: {fmt(fast and fast['speedup'])}x tokens/s (target >= 2.5)")
    draft = lookup(table, 1, 0.8, "draft")
    draft8 = lookup(table, 1, 0.8, "draft_fp8")
    lines.append(f"(c) acceptance 0.8, batch 1, draft model: {fmt(draft and draft['speedup'])}x tokens/s (target >= 1.8); "
                 f"its FP8 draft: {fmt(draft8 and draft8['speedup'])}x")
    lines.append("")
    lines.append(f"{'batch':>5} {'mode':9} {'accept':>6} {'tok/step':>8} {'(expect)':>8} {'tok/s':>9} {'speedup':>7} "
                 f"{'step ms':>8} {'step x':>6} {'device ms':>9} {'host ms':>7}")
    for batch, entry in table.items():
        base = entry["plain"]
        if base is not None:
            lines.append(f"{batch:>5} {'off':9} {'-':>6} {1.0:>8.3f} {'':>8} {fmt(base['decode_tokens_per_s'], '.1f'):>9} "
                         f"{'1.00':>7} {fmt(base['step_ms'], '.3f'):>8} {'1.00':>6} {fmt(base['device_ms'], '.3f'):>9} "
                         f"{fmt(base['host_ms'], '.3f'):>7}")
        for kind, mode in KINDS.items():
            if kind not in entry:
                continue
            for p in sorted(entry[kind]["points"], key=lambda p: p["acceptance"]):
                lines.append(f"{batch:>5} {mode:9} {p['acceptance']:>6.2f} {p['tokens_per_step']:>8.3f} "
                             f"{fmt(p['expected_tokens_per_step'], '.3f'):>8} {fmt(p['decode_tokens_per_s'], '.1f'):>9} "
                             f"{fmt(p['speedup']):>7} {fmt(p['step_ms'], '.3f'):>8} {fmt(p['step_ratio']):>6} "
                             f"{fmt(p['device_ms'], '.3f'):>9} {fmt(p['host_ms'], '.3f'):>7}")
            even = entry[kind]["break_even_acceptance"]
            text = ("not measured" if even is None else "pays at every acceptance measured" if even == "always"
                    else "never pays in the range measured" if even == "never" else f"pays above acceptance {even:.2f}")
            lines.append(f"      batch {batch} {mode}: {text}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    table = summarise(args.work)
    print(render(table))
    if args.json is not None:
        args.json.write_text(json.dumps({str(k): v for k, v in table.items()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
