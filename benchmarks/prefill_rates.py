"""The matmul and flash-attention rates of a long prompt's chunked prefill, measured alone on this device: the
rates the TTFT compute bound of benchmarks/fp8_summary.py takes (its `--peak-tflops` / `--attention-tflops`,
or this script's JSON in the run's work directory).

    PYTHONPATH=. python3 benchmarks/prefill_rates.py [--config-json configs/models/llama3.1-8b/config.json]
        [--chunk 8192] [--prompt 32768] [--fp8] [--json rates.json]

matmul: the prefill step's four projection GEMMs of one layer at `--chunk` rows (bf16 x [T, D] @ [D, out],
    out = (N + 2K)H for qkv, D for o, 2F for gate/up, then [T, F] @ [F, D] for down), each jitted alone:
    their FLOPs (2 * T * in * out each) over the sum of their times.
attention: the flash attention (`pallas_kernels.flash_attention`, as the engine calls it: the Mosaic GPU
    kernel on Hopper) of each `--chunk`-row chunk of a `--prompt`-token prompt over the chunks before it
    (q [1, chunk, N, H] at q_offset c * chunk over K/V [1, (c + 1) * chunk, K, H]): the prompt's causal
    FLOPs (4 * N * H per query-key pair, query i seeing i + 1 keys) over the sum of the chunks' times.
fp8 (`--fp8`, first): the same four GEMMs as the engine runs them with FP8 weights on a prefill-sized step
    (quant.w8a8: per-row fp8 activations times the fp8 weight held [N, K], W8A8 through XLA), compiled under
    each option set of `fp8_option_sets` (the engine's FP8 step options: cuBLASLt, its algorithms timed; the
    same at autotune level 0, cuBLASLt's first choice untimed; XLA's default Triton GEMMs, autotuned), each
    with its compile time.
Each time is the median of `--repeats` calls after one warm-up call. `--smoke`: tiny shapes on a CPU (the
flash attention in interpret mode), for the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.models import quant
from jaxserve.runner.step_program import gpu_compiler_options
from pallas_kernels.flash_attention import flash_attention


def median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """A layer's projection GEMMs as (in, out)."""
    d, h = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n, k, f = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    return {"qkv": (d, (n + 2 * k) * h), "o": (n * h, d), "gate_up": (d, 2 * f), "down": (f, d)}


def matmul_rate(cfg: dict, chunk: int, repeats: int) -> dict:
    dot = jax.jit(jnp.dot)
    key = jax.random.key(0)
    flops = seconds = 0.0
    per = {}
    for name, (inner, outer) in gemm_shapes(cfg).items():
        x = jax.random.normal(key, (chunk, inner), jnp.bfloat16)
        w = jax.random.normal(key, (inner, outer), jnp.bfloat16) * inner ** -0.5
        s = median_s(dot, x, w, repeats=repeats)
        per[name] = {"us": s * 1e6, "tflops": 2 * chunk * inner * outer / s / 1e12}
        flops, seconds = flops + 2 * chunk * inner * outer, seconds + s
    return {"tflops": flops / seconds / 1e12, "gemms": per}


def fp8_option_sets() -> dict[str, dict]:
    """The compile options fp8_rates compares: the engine's FP8 step options (cuBLASLt, XLA timing its
    candidate algorithms), the same at autotune level 0 (cuBLASLt's first choice, untimed), and the default
    options (XLA's Triton GEMMs, autotuned)."""
    untuned = {**gpu_compiler_options(True), "xla_gpu_autotune_level": 0}
    return {"engine": gpu_compiler_options(True), "cublas_untuned": untuned, "autotuned": gpu_compiler_options(False)}


def fp8_rates(cfg: dict, chunk: int, repeats: int) -> dict:
    """The W8A8 GEMMs (quant.w8a8 over weights held [N, K]) under each of fp8_option_sets: per option set,
    each GEMM's time, rate and compile seconds, and the four's rate; printed as each set finishes."""
    key = jax.random.key(0)
    w8a8 = jax.jit(lambda x, q, scale: quant.w8a8(x, q, scale, transposed=True))
    gemms = {}
    for name, (inner, outer) in gemm_shapes(cfg).items():
        x = jax.random.normal(key, (chunk, inner), jnp.bfloat16)
        w = quant.quantize(jax.random.normal(key, (inner, outer), jnp.bfloat16) * inner ** -0.5, 1)
        gemms[name] = (x, w.q.T, w.scale.reshape(outer))  # (q held [N, K], as the engine holds it)
    result = {}
    for label, options in fp8_option_sets().items():
        flops = seconds = 0.0
        per = {}
        for name, (x, q, scale) in gemms.items():
            start = time.perf_counter()
            program = w8a8.lower(x, q, scale).compile(options)
            compile_s = time.perf_counter() - start
            s = median_s(program, x, q, scale, repeats=repeats)
            gemm_flops = 2 * x.shape[0] * x.shape[1] * q.shape[0]
            per[name] = {"us": s * 1e6, "tflops": gemm_flops / s / 1e12, "compile_s": compile_s}
            flops, seconds = flops + gemm_flops, seconds + s
            print(f"fp8 {label:12s} {name:8s} {chunk} rows: {s * 1e6:9.1f} us  {per[name]['tflops']:6.1f} "
                  f"TFLOP/s  (compile {compile_s:.1f} s)", flush=True)
        result[label] = {"options": options, "tflops": flops / seconds / 1e12, "gemms": per}
        print(f"fp8 {label}: {result[label]['tflops']:.1f} TFLOP/s {options}", flush=True)
    return result


def attention_rate(cfg: dict, chunk: int, prompt: int, repeats: int, interpret: bool) -> dict:
    n, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg.get("head_dim") or cfg["hidden_size"] // n
    key = jax.random.key(1)
    attend = jax.jit(lambda q, kk, v, off: flash_attention(q, kk, v, q_offset=off, interpret=interpret))
    seconds, per = 0.0, []
    for c in range(prompt // chunk):
        q = jax.random.normal(key, (1, chunk, n, h), jnp.bfloat16)
        kv = jax.random.normal(key, (2, 1, (c + 1) * chunk, k, h), jnp.bfloat16)
        s = median_s(attend, q, kv[0], kv[1], jnp.asarray([c * chunk], jnp.int32), repeats=repeats)
        per.append({"offset": c * chunk, "us": s * 1e6})
        seconds += s
    tokens = prompt // chunk * chunk
    flops = 4 * n * h * tokens * (tokens + 1) / 2
    return {"tflops": flops / seconds / 1e12, "chunks": per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config-json", type=Path, default=Path("configs/models/llama3.1-8b/config.json"))
    parser.add_argument("--chunk", type=int, default=8192, help="prefill rows per step (max_num_batched_tokens)")
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fp8", action="store_true", help="also the W8A8 GEMMs of an FP8-weight prefill step")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode: a CPU check")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = json.loads(args.config_json.read_text())
    if args.smoke:
        cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "intermediate_size": 128}
        args.chunk, args.prompt, args.repeats = 32, 64, 1
    result = {"device": jax.devices()[0].device_kind, "chunk": args.chunk, "prompt": args.prompt}
    if args.fp8:  # (first: its lines print as they come, the slowest compiles last)
        result["fp8"] = fp8_rates(cfg, args.chunk, args.repeats)
    result |= {"matmul": matmul_rate(cfg, args.chunk, args.repeats),
               "attention": attention_rate(cfg, args.chunk, args.prompt, args.repeats, interpret=args.smoke)}
    result["matmul_tflops"] = result["matmul"]["tflops"]
    result["attention_tflops"] = result["attention"]["tflops"]
    for name, gemm in result["matmul"]["gemms"].items():
        print(f"matmul {name:8s} {args.chunk} rows: {gemm['us']:9.1f} us  {gemm['tflops']:6.1f} TFLOP/s")
    for part in result["attention"]["chunks"]:
        print(f"flash chunk at {part['offset']:6d}: {part['us']:9.1f} us")
    print(f"prefill rates: matmul {result['matmul_tflops']:.1f} TFLOP/s, flash attention "
          f"{result['attention_tflops']:.1f} TFLOP/s ({result['device']})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
