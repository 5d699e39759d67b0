"""`jaxserve bench latency`: the latency of one batch of B requests with fixed lengths (vLLM's `bench latency`).

    per iteration: B random token-id prompts of --input-len (fresh ones, so the prefix cache never turns
    the prefill into a hit), each generating exactly --output-len tokens (ignore_eos), queued together
    and stepped to the end; --num-iters-warmup untimed iterations, then --num-iters timed ones
    -> batch latency (mean, p50/p90/p99), TTFT, TPOT, ITL, decode tokens/s, per-step breakdown,
       device idle share, compiled shapes, start-up compile time, roofline share

    decode tokens/s of an iteration = sum over requests of (output tokens - 1)
                                      / (last finish - first first token)
    roofline (formula in common.py): B rows at mean context input_len + output_len / 2
    speculative decoding (bench/spec.py): the spec_decode counters of the timed iterations; with
    --spec-synthetic-acceptance A1,A2,... one engine measures each in turn (warm-up included), the
    report's top level is A1's and `synthetic_sweep` lists them all

    jaxserve bench latency --config configs/llama3-8b-dummy.yaml --batch-size 1 --input-len 128 --output-len 512
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxserve.bench import common, spec


def decode_tokens_per_s(outputs) -> float | None:
    decoded = sum(len(out.outputs[0].token_ids) - 1 for out in outputs)
    window = (max(out.metrics.finished_time for out in outputs)
              - min(out.metrics.first_token_time for out in outputs))
    return decoded / window if decoded and window > 0 else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    if args.spec_synthetic_acceptance is not None and len(set(args.spec_synthetic_acceptance)) != len(
            args.spec_synthetic_acceptance):
        raise ValueError(f"--spec-synthetic-acceptance lists a value twice: {args.spec_synthetic_acceptance}")
    config = common.engine_config(args)
    engine, init_s = common.make_engine(config, progress=not args.disable_tqdm)
    rng = np.random.default_rng(args.seed)
    # One engine runs each synthetic acceptance in turn (its warm-up iterations too: a new acceptance
    # may reach step shapes the earlier ones did not); the report's top level is the first one's.
    reports = [measure(args, engine, rng, acceptance) for acceptance in spec.acceptances(args)]
    report = {"mode": "latency", "args": common.args_dict(args), **reports[0],
              "engine": common.engine_report(engine, init_s)}
    if len(reports) > 1:
        report["synthetic_sweep"] = reports
    return report


def measure(args: argparse.Namespace, engine, rng: np.random.Generator, acceptance: float | None) -> dict[str, Any]:
    """Warm-up then timed iterations at one synthetic acceptance (None: none) -> the report's figures."""
    spec.set_acceptance(engine, acceptance)
    params = [common.sampling_params(args, args.output_len)] * args.batch_size

    def iteration():
        prompts = common.random_prompts(rng, args.batch_size, args.input_len, engine.vocab_size)
        return common.run_batch(engine, prompts, params, progress=False)

    for _ in tqdm(range(args.num_iters_warmup), desc="warmup iterations", disable=args.disable_tqdm):
        iteration()
    before = spec.counters(engine)
    runs = [iteration() for _ in tqdm(range(args.num_iters), desc="timed iterations", disable=args.disable_tqdm)]
    spec_decode = spec.report(engine, before, spec.counters(engine), acceptance)

    latencies = [r.elapsed_s for r in runs]
    decode_rates = [rate for rate in (decode_tokens_per_s(r.outputs) for r in runs) if rate is not None]
    decode_rate = float(np.mean(decode_rates)) if decode_rates else None
    roofline = common.roofline(engine.model.config, args.batch_size, args.input_len + args.output_len / 2,
                               engine.config.parallel.model, kv_dtype=engine.runner.kv_dtype)
    steps = common.step_report([r.steps for r in runs])
    # The roofline share compares a decode step's rate: the steady pure-decode rate when the run had
    # such steps (prefill steps of other requests otherwise stretch the decode window).
    rate = steps["steady_decode"]["tokens_per_s"] or decode_rate
    return {
        "latency_ms": common.summary(latencies),
        "latencies_s": latencies,
        "decode_tokens_per_s": decode_rate,
        **common.request_report([out for r in runs for out in r.outputs]),
        "steps": steps,
        **({"spec_decode": spec_decode} if spec_decode is not None else {}),
        "roofline": roofline,
        "roofline_share": rate / roofline["tokens_per_s"] if rate is not None else None,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve bench latency", description=__doc__.split("\n")[0])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    common.add_sampling_args(parser)
    common.add_engine_args(parser)
    spec.add_args(parser, several=True)
    return parser


def sweep_line(args: argparse.Namespace, run: dict[str, Any]) -> str:
    """One line per synthetic acceptance of a sweep."""
    section, rate, tpot = run["spec_decode"], run["decode_tokens_per_s"], run["tpot_ms"]
    tpot_text = "n/a" if tpot is None else f"{tpot['mean']:.3f}"
    return (f"synthetic acceptance {section['synthetic_acceptance']:g} (outputs not meaningful), batch "
            f"{args.batch_size}: decode {'n/a' if rate is None else f'{rate:.1f}'} tokens/s, TPOT "
            f"{tpot_text} ms, mean accepted length "
            f"{section['mean_accepted_length'] or 0:.3f} (expected {section['expected_mean_accepted_length']:.3f})")


def main(argv: list[str]) -> int:
    def body(args: argparse.Namespace) -> None:
        report = run(args)
        latency, rate = report["latency_ms"], report["decode_tokens_per_s"]
        print(f"Avg latency: {latency['mean'] / 1e3:.4f} s  (p50 {latency['p50'] / 1e3:.4f}, "
              f"p90 {latency['p90'] / 1e3:.4f}, p99 {latency['p99'] / 1e3:.4f}; {args.num_iters} iterations)")
        print(f"Decode: {'n/a' if rate is None else f'{rate:.1f}'} tokens/s at batch {args.batch_size}")
        common.print_report(report)
        for entry in report.get("synthetic_sweep", []):
            print(sweep_line(args, entry))
        common.write_json(args.output_json, report)

    return common.run_main(body, argv, build_parser())
