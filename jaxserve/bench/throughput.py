"""`jaxserve bench throughput`: offline throughput of N prompts queued at once (vLLM's `bench throughput`).

    prompts: --dataset-path JSON lines ({"prompt_token_ids": [...], "output_len": N} or {"prompt": "..."};
             output_len defaults to --output-len; the first --num-prompts), else --num-prompts random
             token ids of --input-len (prompts.py: the same requests as `bench serve --random-input-len`
             with the same --seed, lengths and tokenizer; the report's prompts_fingerprint shows it)
    -> one Engine (per-step records on) -> all queued, stepped to the end (ignore_eos, max_tokens =
       output_len, greedy unless --temperature)
    -> requests/s, total and output tokens/s, TTFT / TPOT / ITL percentiles, per-step breakdown, device
       idle share, compiled shapes, start-up compile time, roofline tokens/s and the share reached,
       speculative decoding's counters (bench/spec.py; --speculative-config, --spec-synthetic-acceptance A)

The roofline (formula in common.py) is taken at the measured mean decode rows per step and the mean
context prompt + output / 2; output tokens/s also pays for the prefill, so the share is a lower bound.

    jaxserve bench throughput --config configs/llama3-8b-dummy.yaml --num-prompts 1000 \\
        --input-len 1024 --output-len 256 --output-json throughput.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.bench import common, prompts, spec


def bench_requests(args: argparse.Namespace, engine) -> list[prompts.BenchRequest]:
    """--dataset-path's first --num-prompts requests, else random token ids drawn as `bench serve` draws
    them: from the engine tokenizer's vocabulary less its special ids (the model's without a tokenizer)."""
    if args.dataset_path is not None:
        return prompts.read_requests(args.dataset_path, args.output_len)[:args.num_prompts]
    tokenizer = engine.tokenizer
    vocab_size = engine.vocab_size if tokenizer is None else min(len(tokenizer), engine.vocab_size)
    special = () if tokenizer is None else tokenizer.all_special_ids
    return prompts.random_requests(args.seed, args.num_prompts, args.input_len, args.output_len,
                                   args.random_range_ratio, vocab_size, special)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.spec_synthetic_acceptance is not None and len(args.spec_synthetic_acceptance) > 1:
        raise ValueError(f"--spec-synthetic-acceptance takes one value in throughput mode (a list runs in "
                         f"latency mode), got {args.spec_synthetic_acceptance}")
    config = common.engine_config(args)
    engine, init_s = common.make_engine(config, progress=not args.disable_tqdm)
    before = spec.counters(engine)
    requests = bench_requests(args, engine)
    engine_prompts = [{"prompt": r.prompt} if isinstance(r.prompt, str) else {"prompt_token_ids": r.prompt}
                      for r in requests]
    params = [common.sampling_params(args, r.output_len) for r in requests]
    result = common.run_batch(engine, engine_prompts, params, progress=not args.disable_tqdm)
    spec_decode = spec.report(engine, before, spec.counters(engine), config.speculative.synthetic_acceptance)

    outputs, elapsed = result.outputs, result.elapsed_s
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    steps = common.step_report([result.steps])
    batch = steps["mean_decode_rows_per_step"] or min(len(outputs), config.scheduler.max_num_seqs)
    mean_context = float(np.mean([len(out.prompt_token_ids) + len(out.outputs[0].token_ids) / 2 for out in outputs]))
    roofline = common.roofline(engine.model.config, batch, mean_context, engine.config.parallel.model,
                               kv_dtype=engine.runner.kv_dtype)
    return {
        "mode": "throughput",
        "args": common.args_dict(args),
        "prompts_fingerprint": prompts.fingerprint(requests),
        "num_requests": len(outputs),
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        **common.request_report(outputs),
        "steps": steps,
        **({"spec_decode": spec_decode} if spec_decode is not None else {}),
        "engine": common.engine_report(engine, init_s),
        "roofline": roofline,
        "roofline_share": output_tokens / elapsed / roofline["tokens_per_s"],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve bench throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens of each random prompt")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random lengths drawn uniformly in [len * (1 - r), len * (1 + r)]")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--dataset-path", type=Path, help="JSON lines of requests instead of random prompts")
    common.add_sampling_args(parser)
    common.add_engine_args(parser)
    spec.add_args(parser, several=False)
    return parser


def main(argv: list[str]) -> int:
    def body(args: argparse.Namespace) -> None:
        report = run(args)
        print(f"Throughput: {report['requests_per_s']:.2f} requests/s, {report['total_tokens_per_s']:.2f} total "
              f"tokens/s, {report['output_tokens_per_s']:.2f} output tokens/s")
        print(f"Total num prompt tokens: {report['total_prompt_tokens']}  Total num output tokens: "
              f"{report['total_output_tokens']}  ({report['num_requests']} requests in {report['elapsed_s']:.2f} s; "
              f"prompts {report['prompts_fingerprint']})")
        common.print_report(report)
        common.write_json(args.output_json, report)

    return common.run_main(body, argv, build_parser())
