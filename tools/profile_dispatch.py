"""Where the host time of ModelRunner.dispatch goes, on the device machine (8B dummy, batch 1).

    PYTHONPATH=. python3 tools/profile_dispatch.py [--config configs/llama3-8b-dummy.yaml]

Times each piece of dispatch with perf_counter after a warm-up: prepare (host numpy), the forward
(staging the inputs into the step's reused buffers, then the step; returns once enqueued), the
sampler call, the async copy, the wait for the sampled tokens.

--trace DIR [--overlap]: a jax.profiler trace of --trace-steps engine steps (with --overlap, of the
engine's own overlapped loop). --loop N: the engine's step period against N decode forwards queued
back to back (loop_periods), which tells the GPU's own step time from the host's share.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxserve.bench.common import random_prompts, run_batch, step_report
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
    parser.add_argument("--trace", default=None, help="write a jax.profiler trace (perfetto json too) of --trace-steps steps here")
    parser.add_argument("--trace-steps", type=int, default=5, help="steps in the trace")
    parser.add_argument("--loop", type=int, default=0,
                        help="then N engine steps with overlap (the step period), and N forwards of one decode "
                             "step queued back to back (the device's own period when the host keeps ahead)")
    parser.add_argument("--overlap", action="store_true",
                        help="trace the steps with overlap scheduling on (as the engine serves), after 20 steps of it")
    args = parser.parse_args()
    overrides = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    config = load_config(args.config, precompile=False, async_scheduling=False, **overrides)
    engine = Engine(config, progress=False, record_step_stats=args.loop > 0)  # (--loop toggles them)
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
        if args.overlap:  # the engine's own loop: step N+1 dispatched before step N is read back
            engine.async_scheduling = True
            for _ in range(20):
                engine.step()
        jax.profiler.start_trace(args.trace, create_perfetto_trace=True)
        for _ in range(args.trace_steps):
            with jax.profiler.TraceAnnotation("engine_step"):
                engine.step()
        jax.block_until_ready(runner.kv_caches)
        jax.profiler.stop_trace()
    if args.loop:
        loop_periods(engine, args.loop)
    leaves = len(jax.tree.leaves(runner.model.params)) + len(jax.tree.leaves(runner.kv_caches))
    print(f"batch {args.batch}, {leaves} param+cache leaves, {jax.devices()[0].device_kind}; median ms:")
    for name, values in times.items():
        print(f"  {name:18s} {np.median(values):8.3f}")


def loop_periods(engine: Engine, n: int) -> None:
    """The engine's step period under overlap (without and with the step records `jaxserve bench`
    keeps), the steady decode step of `jaxserve bench latency`'s own loop in this process, then the
    period of `n` decode forwards queued back to back with no host work between them (each call still
    stages its inputs and launches the step), and the host time of one such call: if that host time
    is below the queued period, the queued period is the device's own time per step."""
    runner = engine.runner
    engine.async_scheduling = True

    def engine_period() -> float:
        for _ in range(20):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        jax.block_until_ready(runner.kv_caches)
        return (time.perf_counter() - t0) / n * 1e3

    recorder = engine.step_recorder
    engine.remove_observer(recorder)
    engine_ms = engine_period()
    # the same with the step records `jaxserve bench` keeps (a watcher thread waits on each step)
    engine.add_observer(recorder)
    stats_ms = engine_period()
    # and `jaxserve bench latency`'s own loop: 3 runs of one request (128 prompt tokens, 256 decoded)
    engine.abort_request(engine.output_processor.request_ids())
    while engine.has_unfinished_requests():
        engine.step()
    rng = np.random.default_rng(1)
    prompt_len, output_len = min(128, engine.max_model_len // 4), min(256, engine.max_model_len // 2)
    runs = [run_batch(engine, random_prompts(rng, 1, prompt_len, engine.vocab_size),
                      [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)], False).steps
            for _ in range(3)]
    steady = step_report(runs)["steady_decode"]["step_ms"]
    print(f"bench loop (3 x {prompt_len} in / {output_len} out): steady decode step ms p50 {steady['p50']:.3f} "
          f"mean {steady['mean']:.3f} p90 {steady['p90']:.3f}")
    engine.remove_observer(recorder)
    engine.add_request({"prompt_token_ids": rng.integers(0, engine.vocab_size, 16).tolist()},
                       SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - 16, ignore_eos=True))
    for _ in range(10):
        engine.step()
    engine.step()  # the step in flight is processed; the next one is left staged for the queue below
    out = engine.scheduler.schedule()
    step = runner.prepare(out)
    prev = runner._last.tokens
    for _ in range(3):
        runner._run_forward(step.batch, prev, step.prev_index, step.decode_only)
    jax.block_until_ready(runner.kv_caches)
    host = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        _, tokens = runner._run_forward(step.batch, prev, step.prev_index, step.decode_only)
        host.append(time.perf_counter() - t)
    jax.block_until_ready((tokens, runner.kv_caches))
    queued_ms = (time.perf_counter() - t0) / n * 1e3
    print(f"loop of {n}: engine step period {engine_ms:.3f} ms (overlap), {stats_ms:.3f} with step records; "
          f"queued forwards {queued_ms:.3f} ms per step, host {np.median(host) * 1e3:.3f} ms per call (median)")


if __name__ == "__main__":
    main()
