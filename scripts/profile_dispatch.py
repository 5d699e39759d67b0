"""Where the host time of ModelRunner.dispatch goes, on the device machine (8B dummy, batch 1).

    PYTHONPATH=. python3 scripts/profile_dispatch.py [--config configs/llama3-8b-dummy.yaml]

Times each piece of dispatch with perf_counter after a warm-up: prepare (host numpy), the forward
(staging the inputs into the step's reused buffers, then the step; returns once enqueued), the
sampler call, the async copy, the wait for the sampled tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import load_config
from jaxserve.engine import Engine
from jaxserve.runner import model_runner as mr
from jaxserve.runner import sampler
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/llama3-8b-dummy.yaml")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from free memory)")
    parser.add_argument("--trace", default=None, help="write a jax.profiler trace (perfetto json too) of 5 steps here")
    args = parser.parse_args()
    overrides = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    config = load_config(args.config, precompile=False, async_scheduling=False, **overrides)
    engine = Engine(config, progress=False)
    rng = np.random.default_rng(0)
    for _ in range(args.batch):
        engine.add_request({"prompt_token_ids": rng.integers(0, engine.vocab_size, args.prompt_len).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - args.prompt_len,
                                          ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    runner = engine.runner
    times = {k: [] for k in ("schedule", "prepare", "forward", "sample", "copy", "wait", "leaves")}

    def forward(batch, prev_tokens, prev_index, decode_only):
        """The runner's forward (stage the inputs, then the step) on the jit path, not the AOT executables."""
        return runner._run_forward(batch, prev_tokens, prev_index, decode_only)

    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        step = runner.prepare(out)
        t2 = time.perf_counter()
        prev = runner._last.tokens
        logits, greedy = forward(step.batch, prev, step.prev_index, step.decode_only)
        t3 = time.perf_counter()
        md, all_greedy, use_penalties, num_logprobs = step.sampling
        if (greedy is not None and all_greedy and not use_penalties and not num_logprobs
                and not (md.banned_token_ids >= 0).any()):  # the step's own argmax, as the runner takes it
            result = sampler.SamplerOutput(greedy, None)
        else:
            result = sampler.sample(logits, md, all_greedy=all_greedy, use_penalties=use_penalties,
                                    num_logprobs=num_logprobs, out_rows=runner.max_rows)
        t4 = time.perf_counter()
        result.token_ids.copy_to_host_async()
        t5 = time.perf_counter()
        handle = mr.StepHandle(step.request_ids, step.rows, step.generations, result.token_ids, None, result.token_ids)
        runner._last = handle
        engine.scheduler.update_from_output(out, runner.collect(handle))
        t6 = time.perf_counter()
        jax.block_until_ready(logits)
        t7 = time.perf_counter()
        jax.tree.leaves((runner.model.params, runner.kv_caches))
        t8 = time.perf_counter()
        for name, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t8 - t7)):
            times[name].append(value * 1e3)
    if args.trace:
        jax.profiler.start_trace(args.trace, create_perfetto_trace=True)
        for _ in range(5):
            with jax.profiler.TraceAnnotation("engine_step"):
                engine.step()
        jax.block_until_ready(runner.kv_caches)
        jax.profiler.stop_trace()
    leaves = len(jax.tree.leaves(runner.model.params)) + len(jax.tree.leaves(runner.kv_caches))
    print(f"batch {args.batch}, {leaves} param+cache leaves, {jax.devices()[0].device_kind}; median ms:")
    for name, values in times.items():
        print(f"  {name:18s} {np.median(values):8.3f}")


if __name__ == "__main__":
    main()
