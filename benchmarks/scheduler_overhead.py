"""Host time per engine step at N running decode requests, with a fake model.

Measures the host work of one step that is not device time: Scheduler.schedule(), the runner's
host-side preparation (ModelBatch arrays and sampling metadata: ModelRunner.prepare), and
Scheduler.update_from_output() with the runner's collect bookkeeping. The model is never run: sampled tokens come from a
random generator, so only the host path is timed.

    python benchmarks/scheduler_overhead.py [--num-requests 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.models.llama import LlamaConfig  # (a benchmark of the llama family's shapes)
from jaxserve.models.loader import GenerationDefaults, LoadedModel
from jaxserve.request import Request
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_types import StepHandle
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    max_model_len = 4096
    # A one-layer stand-in config: its only role is to size the (tiny) KV arrays the runner allocates.
    cfg = LlamaConfig(vocab_size=32000, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=2, max_position_embeddings=max_model_len, dtype="float32")
    num_blocks = args.num_requests * (max_model_len // args.block_size) // 2 + 1
    config = EngineConfig().with_overrides(
        max_num_seqs=args.num_requests, max_num_batched_tokens=8192, block_size=args.block_size,
        num_blocks=num_blocks, precompile=False, compilation_cache_dir=None)
    runner = ModelRunner(config, model=LoadedModel(None, cfg, None, GenerationDefaults(), {}))
    kv = KVCacheManager(num_blocks, args.block_size, enable_caching=True)
    scheduler = Scheduler(config.scheduler, kv, max_model_len)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_model_len - args.prompt_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
        scheduler.add_request(Request(str(i), prompt, params, eos_token_ids=(2,), seed=i))

    timings = {"schedule": [], "prepare": [], "update": []}
    decode_steps = 0
    while decode_steps < args.steps:
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        step = runner.prepare(out)
        t2 = time.perf_counter()
        tokens = rng.integers(0, cfg.vocab_size, len(step.rows))  # the "device" samples
        runner_output = runner.collect(StepHandle(step.request_ids, step.rows, step.generations, tokens, None, tokens))
        scheduler.update_from_output(out, runner_output)
        t3 = time.perf_counter()
        if out.num_scheduled_tokens == args.num_requests:  # a pure decode step of every request
            decode_steps += 1
            for name, value in zip(timings, (t1 - t0, t2 - t1, t3 - t2)):
                timings[name].append(value * 1e3)

    total = [sum(parts) for parts in zip(*timings.values())]
    print(f"{args.num_requests} running requests, prompt {args.prompt_len}, {args.steps} decode steps")
    print(f"{'part':10s} {'mean ms':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name, values in list(timings.items()) + [("total", total)]:
        print(f"{name:10s} {statistics.mean(values):8.3f} {statistics.median(values):8.3f} "
              f"{float(np.percentile(values, 99)):8.3f}")


if __name__ == "__main__":
    main()
