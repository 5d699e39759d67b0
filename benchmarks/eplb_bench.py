"""The expert rebalancer on a skewed workload: device load and tokens/s before and after a rebalance
(expert parallelism; issue 22's run 2 on a machine of two or more GPUs).

    PYTHONPATH=. python3 benchmarks/eplb_bench.py --config configs/qwen3-30b-a3b-dummy.yaml --expert 2 \
        [--redundant-experts 8] [--num-prompts 256 --input-len 512 --output-len 64] [--skew-vocab 64] [--json F]

The workload: prompts of random ids drawn from only `--skew-vocab` token ids (the same few embeddings, so the
router sends most tokens to a few experts; 0 draws from the whole vocabulary). Phases, one engine:
    warm-up   the workload once (compiles what it needs; its load counts toward the first rebalance)
    before    the workload timed; then Engine.stats() gives the per-layer max/mean device load
    rebalance Engine.rebalance_experts() by the load measured since start-up
    after     the workload timed again on the new placement, and its max/mean device load
Reports tokens/s (output tokens over the phase's seconds) and the mean and worst of the per-layer max/mean
device loads (1.0 = balanced) of each timed phase. `--smoke`: the tiny Qwen3-MoE fixture on 2 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=2), for the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def run_phase(engine, prompts: list[dict], params) -> dict:
    from jaxserve.bench import common
    result = common.run_batch(engine, prompts, [params] * len(prompts), progress=False)
    tokens = sum(len(c.token_ids) for out in result.outputs for c in out.outputs)
    loads = engine.stats().expert_device_load_max_over_mean
    return {"seconds": result.elapsed_s, "output_tokens": tokens, "tokens_per_s": tokens / result.elapsed_s,
            "max_over_mean_mean": sum(loads) / len(loads) if loads else None,
            "max_over_mean_worst": max(loads) if loads else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/qwen3-30b-a3b-dummy.yaml"))
    parser.add_argument("--expert", type=int, default=2, help="parallel.expert: expert shards")
    parser.add_argument("--redundant-experts", type=int, default=8, help="parallel.num_redundant_experts")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skew-vocab", type=int, default=64, help="token ids the prompts draw from (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="the tiny MoE fixture on 2 fake CPU devices")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    overrides = {"parallel.expert": args.expert, "parallel.num_redundant_experts": args.redundant_experts}
    if args.smoke:
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={args.expert}")
        overrides |= {"model": "tests/fixtures/hf/qwen3_moe_8x2_sparse2", "dtype": "float32", "max_model_len": 64,
                      "max_num_seqs": 4, "max_num_batched_tokens": 64, "token_buckets": [64], "request_buckets": [4],
                      "precompile": False}
        args.num_prompts, args.input_len, args.output_len = 8, 16, 8
    import numpy as np

    from jaxserve import SamplingParams
    from jaxserve.bench import common
    from jaxserve.config import load_config

    config = load_config(args.config, **overrides)
    engine, init_s = common.make_engine(config, progress=False)
    vocab = args.skew_vocab or engine.vocab_size
    prompts = common.random_prompts(np.random.default_rng(args.seed), args.num_prompts, args.input_len,
                                    min(vocab, engine.vocab_size))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    run_phase(engine, prompts, params)  # warm-up
    before = run_phase(engine, prompts, params)
    start = time.perf_counter()
    engine.rebalance_experts()
    rebalance_s = time.perf_counter() - start
    after = run_phase(engine, prompts, params)
    report = {"config": str(args.config), "expert": args.expert, "redundant_experts": args.redundant_experts,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "skew_vocab": args.skew_vocab, "engine_init_s": init_s, "before": before, "after": after,
              "rebalance_s": rebalance_s, "speedup": after["tokens_per_s"] / before["tokens_per_s"]}
    for name in ("before", "after"):
        phase = report[name]
        print(f"{name:6s}: {phase['tokens_per_s']:9.1f} tok/s  device load max/mean per layer: mean "
              f"{phase['max_over_mean_mean']:.3f}, worst {phase['max_over_mean_worst']:.3f}")
    print(f"rebalance: {rebalance_s:.2f} s; tokens/s after / before: {report['speedup']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
