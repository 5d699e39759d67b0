"""The online path against the offline one, from the JSON reports of benchmarks/devrun_serve.sh.

    throughput.json (`jaxserve bench throughput`), serve_inf.json (`jaxserve bench serve --request-rate inf`
    on the same prompts), optionally serve_rate.json (`bench serve` at a fixed rate, with
    --metric-percentiles 50,90,99)
    -> a Markdown table: output and total tokens/s of each, the online / offline ratios (target >= 0.9x),
       whether both ran the same prompts (their prompts_fingerprint), TTFT / ITL / TPOT percentiles

    python benchmarks/serve_vs_offline.py throughput.json serve_inf.json serve_rate.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = 0.9


def percentiles(report: dict, name: str) -> str:
    values = [report.get(f"p{q}_{name}_ms") for q in (50, 90, 99)]
    return "n/a" if None in values else " / ".join(f"{v:.1f}" for v in values)


def serve_row(label: str, report: dict) -> str:
    return (f"| {label} | {report['completed']} ok, {report['failed']} failed | {report['duration_s']:.1f} | "
            f"{report['output_throughput']:,.0f} | {report['total_token_throughput']:,.0f} | "
            f"{percentiles(report, 'ttft')} | {percentiles(report, 'itl')} | {percentiles(report, 'tpot')} |")


def summarize(offline: dict, online: dict, rate: dict | None = None) -> str:
    out_ratio = online["output_throughput"] / offline["output_tokens_per_s"]
    total_ratio = online["total_token_throughput"] / offline["total_tokens_per_s"]
    same = offline.get("prompts_fingerprint") == online.get("prompts_fingerprint")
    lines = [
        "| run | requests | s | output tok/s | total tok/s | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 "
        "| TPOT ms p50/p90/p99 |",
        "|---|---|---|---|---|---|---|---|",
        f"| offline `bench throughput` | {offline['num_requests']} | {offline['elapsed_s']:.1f} | "
        f"{offline['output_tokens_per_s']:,.0f} | {offline['total_tokens_per_s']:,.0f} | "
        f"{_offline_percentiles(offline.get('ttft_ms'))} | {_offline_percentiles(offline['steps'].get('itl_ms'))} | "
        f"{_offline_percentiles(offline.get('tpot_ms'))} |",
        serve_row("online `bench serve`, rate inf", online),
    ]
    if rate is not None:
        lines.append(serve_row(f"online `bench serve`, rate {rate['request_rate']} req/s "
                               f"(achieved {rate['request_throughput']:.2f})", rate))
    lines += [
        "",
        f"online / offline: output tok/s {out_ratio:.3f}x, total tok/s {total_ratio:.3f}x "
        f"(target >= {TARGET}x: {'met' if out_ratio >= TARGET else 'missed'}); same prompts: "
        f"{'yes' if same else 'NO'} ({offline.get('prompts_fingerprint')} / {online.get('prompts_fingerprint')})",
    ]
    return "\n".join(lines)


def _offline_percentiles(stats: dict | None) -> str:
    return "n/a" if not stats else " / ".join(f"{stats[f'p{q}']:.1f}" for q in (50, 90, 99))


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    reports = []
    for path in argv:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (FileNotFoundError, json.JSONDecodeError) as err:
            print(f"error: {path}: {err}", file=sys.stderr)
            return 2
    print(summarize(*reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
