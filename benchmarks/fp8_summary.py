"""The table of benchmarks/devrun_fp8.sh: FP8 weights and FP8 KV cache against bf16, batch-1 decode against its
roofline and the tight loop, and long-prompt TTFT against its compute bound, as ratios within one run.

    python3 benchmarks/fp8_summary.py WORK_DIR [--json summary.json] [--peak-tflops T] [--attention-tflops T]

WORK_DIR holds `jaxserve bench latency --output-json` reports (a missing one is reported as not run):
    bf16_b1, fp8w_b1       (a) batch 1, bf16 vs fp8 weights            target fp8 / bf16 >= 1.8
    bf16_b64, fp8w_b64     (b) batch 64, bf16 vs fp8 weights           target >= 1.4
    kvbf16_ctx8k, kvfp8_ctx8k  (c) batch 64 at context ~8192, bf16 vs fp8 KV cache   target >= 1.3
    ttft_32k, ttft_128k    (e) TTFT of one long prompt (the _flash runs: the flash prefill on)
and tput_bf16.json, tput_bf16_512.json, tput_fp8.json, `jaxserve bench throughput` reports (f: elapsed
seconds, targets <= 38 s bf16 and <= 30 s fp8 for 1000 x 1024 / 256), and tight_b1.json,
benchmarks/tight_loop_decode.py's --output-json at batch 1 (d), beside bf16_b1_exact and fp8w_b1_exact
(bf16_b1 and fp8w_b1 with token rungs that start at 1 row: a and d).

    decode rate   = the bench's steady decode tokens/s (pure-decode steps at the full batch, median step:
                    compile-free), else its decode tokens/s over the whole window
    (d) roofline  = the bench's: batch / ((weight bytes + batch x context x KV bytes per token) / 4.3e12 B/s)
                    (jaxserve/bench/common.py); target share >= 0.92 and >= 1.0x the tight loop's tokens/s
    (e) compute bound of a prefill of S tokens (the model's config.json; D width, F MLP width, L layers, N / K
        query / kv heads, H head dim, V vocabulary; one FLOP pair per multiply-add):
            weight FLOPs    = 2 * S * L * (D*N*H + 2*D*K*H + N*H*D + 3*D*F) + 2 * D * V  (the logits: last row)
            attention FLOPs = 4 * L * N * H * S * (S + 1) / 2   (QK^T and PV, causal: query i sees i + 1 keys)
            bound s         = (weight FLOPs + attention FLOPs) / (peak FLOP/s)
        with the peak the H200's dense bf16 tensor-core rate (--peak-tflops, default 989), or the matmul and
        flash-kernel rates measured elsewhere in the run (--peak-tflops and --attention-tflops);
        TTFT = the bench's p50 TTFT (the median of its timed iterations); target TTFT / bound <= 1.2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAIRS = {  # section -> (baseline report, fp8 report, what changes, target ratio)
    "a": ("bf16_b1", "fp8w_b1", "batch 1 decode, fp8 weights / bf16 weights", 1.8),
    "b": ("bf16_b64", "fp8w_b64", "batch 64 decode, fp8 weights / bf16 weights", 1.4),
    "c": ("kvbf16_ctx8k", "kvfp8_ctx8k", "batch 64 context ~8K decode, fp8 KV / bf16 KV", 1.3),
}
TTFT = ("ttft_32k", "ttft_32k_flash", "ttft_128k", "ttft_128k_flash")
ROOFLINE_TARGET, TTFT_TARGET = 0.92, 1.2
# report -> target elapsed seconds (1000 x 1024 / 256); tput_bf16_512: bf16 at 512 sequences / 16384 tokens
THROUGHPUT = {"tput_bf16": 38.0, "tput_bf16_512": 38.0, "tput_fp8": 30.0}
H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of the H200 (SXM)


def load(work: Path, name: str) -> dict | None:
    path = work / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def decode_row(report: dict | None) -> dict | None:
    if report is None:
        return None
    steady = report["steps"]["steady_decode"]
    roof, engine = report["roofline"], report["engine"]
    return {"tokens_per_s": steady["tokens_per_s"] or report["decode_tokens_per_s"],
            "steady": steady["tokens_per_s"] is not None, "window_tokens_per_s": report["decode_tokens_per_s"],
            "batch": roof["batch"], "mean_context": roof["mean_context"],
            "tpot_ms": (report.get("tpot_ms") or {}).get("mean"),
            "roofline_tokens_per_s": roof["tokens_per_s"], "roofline_share": report["roofline_share"],
            "weight_gb": roof["read_weight_bytes"] / 1e9, "kv_bytes_per_token": roof["kv_bytes_per_token"],
            "bytes_per_step_gb": roof["bytes_per_step"] / 1e9, "num_kv_blocks": engine["num_kv_blocks"],
            "num_compiled": engine["num_compiled"], "device": engine["device"],
            "attention_backend": engine["attention_backend"]}


def prefill_flops(hf: dict, tokens: int) -> dict[str, float]:
    """The (e) formula of the module docstring, from a config.json."""
    d, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    n = hf["num_attention_heads"]
    k = hf.get("num_key_value_heads", n)
    h = hf.get("head_dim") or d // n
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    weight = 2.0 * tokens * layers * per_layer + 2.0 * d * hf["vocab_size"]
    attention = 4.0 * layers * n * h * tokens * (tokens + 1) / 2
    return {"weight_flops": weight, "attention_flops": attention}


def ttft_row(report: dict | None, matmul_tflops: float, attention_tflops: float) -> dict | None:
    if report is None or report.get("ttft_ms") is None:
        return None
    config = report["engine"]["config"]
    hf = json.loads((Path(config["model"]["path"]) / "config.json").read_text())
    tokens = int(report["args"]["input_len"])
    flops = prefill_flops(hf, tokens)
    bound_s = flops["weight_flops"] / (matmul_tflops * 1e12) + flops["attention_flops"] / (attention_tflops * 1e12)
    peak_bound_s = (flops["weight_flops"] + flops["attention_flops"]) / (H200_BF16_TFLOPS * 1e12)
    ttft_s = report["ttft_ms"]["p50"] / 1e3
    return {"prompt_tokens": tokens, **flops, "matmul_tflops": matmul_tflops, "attention_tflops": attention_tflops,
            "bound_s": bound_s, "ttft_s": ttft_s, "ttft_max_s": report["ttft_ms"]["max"] / 1e3,
            "iterations": report["ttft_ms"]["count"], "ttft_over_bound": ttft_s / bound_s,
            "peak_bound_s": peak_bound_s, "ttft_over_peak_bound": ttft_s / peak_bound_s,
            "achieved_tflops": (flops["weight_flops"] + flops["attention_flops"]) / ttft_s / 1e12,
            "kv_cache_dtype": config["cache"]["kv_cache_dtype"], "num_compiled": report["engine"]["num_compiled"]}


def tight_row(work: Path) -> dict | None:
    path = work / "tight_b1.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]  # (one per --executables choice: the fastest is the peer)
    return max(rows, key=lambda row: row["tokens_per_s"]) if rows else None


def summarise(work: Path, matmul_tflops: float | None = None, attention_tflops: float | None = None) -> dict:
    """The table's content. The TTFT bound's rates: the arguments where given, else the run's
    prefill_rates.json, else the H200's bf16 peak."""
    summary: dict = {}
    rates = load(work, "prefill_rates") or {}
    matmul_tflops = matmul_tflops or rates.get("matmul_tflops") or H200_BF16_TFLOPS
    attention_tflops = attention_tflops or rates.get("attention_tflops") or matmul_tflops
    for key, (base_name, fp8_name, what, target) in PAIRS.items():
        base, fp8 = decode_row(load(work, base_name)), decode_row(load(work, fp8_name))
        summary[key] = {"what": what, "target": target, base_name: base, fp8_name: fp8,
                        "ratio": ratio(fp8 and fp8["tokens_per_s"], base and base["tokens_per_s"])}
    b1, tight = summary["a"]["bf16_b1"], tight_row(work)
    summary["d"] = {"roofline_share": b1 and b1["roofline_share"], "roofline_target": ROOFLINE_TARGET,
                    "exact_rungs": decode_row(load(work, "bf16_b1_exact")),
                    "fp8_exact_rungs": decode_row(load(work, "fp8w_b1_exact")), "tight_loop": tight,
                    "over_tight_loop": ratio(b1 and b1["tokens_per_s"], tight and tight["tokens_per_s"])}
    summary["e"] = {name: ttft_row(load(work, name), matmul_tflops, attention_tflops) for name in TTFT}
    summary["e"]["target"] = TTFT_TARGET
    summary["e"]["rates"] = "measured (prefill_rates.json)" if rates else "given or peak"
    summary["f"] = {}
    for name, target in THROUGHPUT.items():
        report = load(work, name)
        summary["f"][name] = None if report is None else {
            "elapsed_s": report["elapsed_s"], "output_tokens_per_s": report["output_tokens_per_s"],
            "num_prompts": report.get("num_requests", report.get("args", {}).get("num_prompts")), "target_s": target}
    bf16, fp8 = summary["f"]["tput_bf16"], summary["f"]["tput_fp8"]
    summary["f"]["fp8_over_bf16"] = ratio(bf16 and bf16["elapsed_s"], fp8 and fp8["elapsed_s"])
    return summary


def _f(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _met(value, target: float, at_least: bool = True) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if at_least else value <= target) else "missed"


def render(summary: dict) -> str:
    lines = ["=== decode tokens/s (steady pure-decode steps), fp8 against bf16 in the same run",
             f"{'run':14s} {'tok/s':>9s} {'batch':>5s} {'ctx':>6s} {'TPOT ms':>8s} {'GB/step':>8s} {'roofline':>9s} "
             f"{'share':>6s} {'KV B/tok':>8s} {'KV blocks':>9s} {'shapes':>6s}"]
    not_run = []
    for key, entry in summary.items():
        if key not in PAIRS:
            continue
        for name in PAIRS[key][:2]:
            r = entry[name]
            if r is None:
                lines.append(f"{name:14s} (not run)")
                not_run.append(name)
                continue
            share = r["roofline_share"]
            lines.append(f"{name:14s} {_f(r['tokens_per_s'], '.1f'):>9s}{'' if r['steady'] else '*'} {r['batch']:5.0f} "
                         f"{r['mean_context']:6.0f} {_f(r['tpot_ms'], '.3f'):>8s} {r['bytes_per_step_gb']:8.2f} "
                         f"{r['roofline_tokens_per_s']:9.1f} {_f(share and 100 * share, '.0f'):>5s}% "
                         f"{r['kv_bytes_per_token']:8d} {r['num_kv_blocks']:9d} {r['num_compiled']:6d}")
        lines.append(f"  ({key}) {entry['what']}: {_f(entry['ratio'])}x (target >= {entry['target']}: "
                     f"{_met(entry['ratio'], entry['target'])})")
    rows = [entry[name] for key, entry in summary.items() if key in PAIRS for name in PAIRS[key][:2]]
    if any(r is not None and not r["steady"] for r in rows):
        lines.append("  (* no steady pure-decode steps: the whole decode window's rate)")
    d = summary["d"]
    tight = d["tight_loop"]
    lines.append("")
    lines.append(f"(d) bf16 batch 1: {_f(d['roofline_share'] and 100 * d['roofline_share'], '.1f')}% of the roofline "
                 f"(target >= {100 * ROOFLINE_TARGET:.0f}%: {_met(d['roofline_share'], ROOFLINE_TARGET)}); "
                 f"{_f(d['over_tight_loop'])}x the tight loop (target >= 1.0: {_met(d['over_tight_loop'], 1.0)})")
    exact, fp8_exact = d["exact_rungs"], d["fp8_exact_rungs"]
    if exact is not None:
        lines.append(f"    with token rungs from 1 row (bf16_b1_exact): {_f(exact['tokens_per_s'], '.1f')} tokens/s, "
                     f"{_f(exact['roofline_share'] and 100 * exact['roofline_share'], '.1f')}% of the roofline")
    if exact is not None and fp8_exact is not None:
        lines.append(f"    fp8 weights on those rungs (fp8w_b1_exact): {_f(fp8_exact['tokens_per_s'], '.1f')} tokens/s, "
                     f"{_f(ratio(fp8_exact['tokens_per_s'], exact['tokens_per_s']))}x bf16_b1_exact")
    if tight is None:
        not_run.append("tight_b1")
        lines.append("    tight loop: (not run)")
    else:
        lines.append(f"    tight loop: {tight['tokens_per_s']:.1f} tokens/s at batch {tight['batch']}, context "
                     f"{tight['context']} + {tight['steps']} steps, {tight.get('executables', 1)} executable(s), "
                     f"{100 * tight['roofline_share']:.1f}% of its roofline")
    lines.append("")
    lines.append("(e) TTFT of one long prompt (p50 of the timed iterations) against its compute bound")
    for name in TTFT:
        r = summary["e"][name]
        if r is None:
            lines.append(f"    {name}: (not run)")
            not_run.append(name)
            continue
        lines.append(f"    {name}: {r['prompt_tokens']} tokens, TTFT {r['ttft_s']:.3f} s (max {r['ttft_max_s']:.3f} s, "
                     f"{r['iterations']} timed), bound {r['bound_s']:.3f} s ({r['weight_flops'] / 1e12:.1f} "
                     f"weight + {r['attention_flops'] / 1e12:.1f} attention TFLOP at {r['matmul_tflops']:.0f} / "
                     f"{r['attention_tflops']:.0f} TFLOP/s, {summary['e']['rates']}): {r['ttft_over_bound']:.2f}x "
                     f"the bound, {r['ttft_over_peak_bound']:.2f}x the bound at the {H200_BF16_TFLOPS:g} TFLOP/s "
                     f"peak, {r['achieved_tflops']:.0f} TFLOP/s achieved"
                     + (f" (target <= {TTFT_TARGET}: {_met(r['ttft_over_bound'], TTFT_TARGET, False)})"
                        if name.startswith("ttft_32k") else ""))
    lines.append("")
    lines.append("(f) offline throughput, 1000 prompts of 1024 in / 256 out (elapsed, compile excluded)")
    for name, target in THROUGHPUT.items():
        r = summary["f"][name]
        if r is None:
            lines.append(f"    {name}: (not run)")
            not_run.append(name)
            continue
        lines.append(f"    {name}: {r['elapsed_s']:.1f} s, {r['output_tokens_per_s']:.0f} output tokens/s "
                     f"(target <= {target:g} s: {_met(r['elapsed_s'], target, False)})")
    if summary["f"]["fp8_over_bf16"] is not None:
        lines.append(f"    fp8 / bf16 throughput: {summary['f']['fp8_over_bf16']:.2f}x")
    if not_run:
        lines.append("")
        lines.append("not run: " + ", ".join(not_run) + " (benchmarks/devrun_fp8.sh weights runs a, b and d; kv "
                     "runs c; long runs e; throughput runs f)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.add_argument("--peak-tflops", type=float,
                        help="the matmul rate of the compute bound (default: WORK_DIR/prefill_rates.json's, else "
                             "the H200's dense bf16 peak)")
    parser.add_argument("--attention-tflops", type=float, help="the attention rate of the bound (default: "
                                                               "prefill_rates.json's, else the matmul rate)")
    args = parser.parse_args()
    summary = summarise(args.work, args.peak_tflops, args.attention_tflops)
    print(render(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
