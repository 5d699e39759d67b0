"""The FP8 decode GEMM kernel (pallas_kernels/fp8_gemm/gpu.py) on one GPU against XLA, at the Llama-3-8B
decode step's weight shapes: bf16 weights through XLA's dot (the bf16 engine's matmul), fp8 weights
dequantized by XLA before the dot (the FP8 reference path), and the kernel over a small sweep of its
tuning (block_n, block_k, warps, stages).

    python3 benchmarks/fp8_gemm.py [--rows 1,16,64] [--quick] [--configs BN,BK,W,S ...] [--shapes ...] [--json OUT]
    python3 benchmarks/fp8_gemm.py --smoke      (CPU: tiny shapes, the kernel in interpret mode)

The bf16 and dequantizing references are vmapped batched dots, which XLA runs slower than the engine's
plain dot (the engine's bf16 decode step streams its weights at ~85% of the roofline): compare the
kernel's GB/s with the bandwidth, not with them (benchmarks/fp8_gemm_mgpu.py times a plain bf16 dot
beside this kernel's default tuning). Each variant is jitted over enough distinct weight copies (~1 GB
of weights) that L2 holds none of them and timed as the wall time of 10 calls queued back to back,
divided by calls and copies: the per-GEMM time with launch gaps, as a decode step pays it. GB/s = the
variant's weight bytes / time (fp8: 1 byte per weight); the share is of 4.3 TB/s. Every variant is
checked against a float32 product first. Prints one line per (shape, rows) with the best kernel
configuration and its speedup over the bf16 dot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_gemm import gpu

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMOKE_SHAPES = {"tiny": (512, 128)}
# The sweep: (block_n, block_k, num_warps, num_stages).
SWEEP = ((64, 256, 4, 3), (128, 256, 4, 3), (64, 512, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4), (256, 64, 4, 4),
         (256, 128, 8, 3), (128, 256, 8, 4), (128, 128, 8, 5), (128, 64, 4, 5))
PEAK_BYTES_PER_S = 4.3e12


def _copies(weight_bytes: int) -> int:
    return max(2, min(64, (1 << 30) // weight_bytes))


def _time(fn, args, calls: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def run(rows_list: list[int], quick: bool, smoke: bool = False, sweep=SWEEP, shapes=None) -> list[dict]:
    key = jax.random.key(0)
    configs = [gpu.TuningConfig()] if quick else [
        gpu.TuningConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s) for bn, bk, w, s in sweep]
    if smoke:
        configs = [gpu.TuningConfig(block_k=128, num_cores=4)]
    results = []
    for name, (k, n) in (SMOKE_SHAPES if smoke else SHAPES).items():
        if shapes and name not in shapes:
            continue
        copies = 2 if smoke else _copies(k * n)
        w32 = jax.random.normal(key, (k, n), jnp.float32)
        scale = jnp.max(jnp.abs(w32), axis=0) / 448
        q = (w32 / scale).astype(gpu.FP8)
        w16 = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        qs = jnp.stack([q] * copies)
        ws = jnp.stack([w16] * copies)
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            ref = np.asarray(x.astype(jnp.float32) @ (q.astype(jnp.float32) * scale))

            def check(out):
                err = float(np.abs(np.asarray(out, np.float32) - ref).max() / (np.abs(ref).max() + 1e-9))
                assert err < 2e-2, f"{name} rows={rows}: relative error {err}"

            bf16 = jax.jit(lambda x, ws: jax.vmap(lambda w: x @ w)(ws))
            dequant = jax.jit(lambda x, qs, s: jax.vmap(lambda q: x @ (q.astype(jnp.float32) * s).astype(x.dtype))(qs))
            check(bf16(x, ws)[0])
            check(dequant(x, qs, scale)[0])
            row = {"shape": name, "k": k, "n": n, "rows": rows,
                   "bf16_us": _time(bf16, (x, ws)) / copies * 1e6,
                   "xla_dequant_us": _time(dequant, (x, qs, scale)) / copies * 1e6}
            best, timed = None, []
            for config in configs:
                if not gpu.supported(rows, k, n, config):
                    continue
                kernel = jax.jit(lambda x, qs, s, c=config: jax.vmap(
                    lambda q: gpu.fp8_matmul(x, q, s, config=c, interpret=smoke))(qs))
                try:
                    check(kernel(x, qs, scale)[0])
                    us = _time(kernel, (x, qs, scale)) / copies * 1e6
                except Exception as err:  # noqa: BLE001 - a configuration the compiler refuses is skipped
                    print(f"  {name} rows={rows} {config}: {type(err).__name__}: {str(err)[:120]}")
                    continue
                timed.append(f"{config.block_n}/{config.block_k}/{config.num_warps}/{config.num_stages} {us:.1f}")
                if best is None or us < best[0]:
                    best = (us, config)
            if best is not None:
                row["kernel_us"] = best[0]
                row["kernel_config"] = {f: getattr(best[1], f) for f in ("block_n", "block_k", "num_warps",
                                                                         "num_stages")}
                row["kernel_splits"] = gpu.num_splits(best[1], k, n)
                row["kernel_gb_per_s"] = k * n / (best[0] * 1e-6) / 1e9
                row["kernel_share"] = row["kernel_gb_per_s"] * 1e9 / PEAK_BYTES_PER_S
                row["speedup_vs_bf16"] = row["bf16_us"] / best[0]
            row["bf16_gb_per_s"] = 2 * k * n / (row["bf16_us"] * 1e-6) / 1e9
            results.append(row)
            print(f"{name:8s} rows {rows:3d}: bf16 {row['bf16_us']:7.1f} us ({row['bf16_gb_per_s']:6.0f} GB/s)  "
                  f"xla dequant {row['xla_dequant_us']:7.1f} us  kernel "
                  + (f"{row['kernel_us']:7.1f} us ({row['kernel_gb_per_s']:6.0f} GB/s, "
                     f"{row['kernel_share']:.0%} of 4.3 TB/s, {row['speedup_vs_bf16']:.2f}x bf16) "
                     f"{row['kernel_config']} splits {row['kernel_splits']}" if "kernel_us" in row else "n/a"),
                  flush=True)
            print(f"         every configuration (block_n/block_k/warps/stages us): {', '.join(timed)}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--quick", action="store_true", help="the default configuration only")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, the kernel interpreted")
    parser.add_argument("--configs", nargs="+", metavar="BN,BK,WARPS,STAGES",
                        help="the sweep (default: SWEEP)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="these shapes only")
    parser.add_argument("--json")
    args = parser.parse_args()
    sweep = tuple(tuple(int(v) for v in c.split(",")) for c in args.configs) if args.configs else SWEEP
    results = run([int(r) for r in args.rows.split(",")], args.quick, args.smoke, sweep, args.shapes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
