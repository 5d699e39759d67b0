"""The W8A8 fp8 decode GEMM on TMA + wgmma (pallas_kernels/fp8_gemm/mosaic_gpu.py: a single-device engine's
decode path) on one H100/H200 at the Llama-3-8B decode step's weight shapes, beside XLA's plain bf16 dot (the
bf16 engine's matmul) and the weight-only fp8 Triton kernel (pallas_kernels/fp8_gemm/gpu.py, default tuning:
a tensor-parallel engine's decode path).

    python3 benchmarks/fp8_gemm_mgpu.py [--rows 1,16,64] [--shapes qkv o ...] [--configs BK,STAGES,SPLITS ...]
                                        [--budget-s 90] [--json OUT]
    python3 benchmarks/fp8_gemm_mgpu.py --smoke      (CPU: a tiny shape, the kernels in interpret mode)

Every variant is a plain jitted call over distinct weight copies (~1 GB of them, so L2 holds none), timed
as the wall time of 10 calls of that program queued back to back, divided by calls and copies: the
per-GEMM time with launch gaps, as a decode step pays it. Nothing is vmapped (a vmapped bf16 dot runs
far below the plain dot's bandwidth). GB/s = the variant's weight bytes / time (fp8: 1 byte per weight,
bf16: 2); the share is of 4.3 TB/s; "x bf16" is the bf16 dot's time over the variant's.

The Mosaic kernel is timed over a small sweep (block_k, stages, splits; splits "auto" = enough K splits
for about one CTA per SM; the first configuration is the engine's, mosaic_gpu.choose_config) with the
activation quantization (one XLA fusion before the kernel) included, and its best configuration once more
without it ("kernel only": x already quantized). Its weights are [N, K] (K contiguous); the Triton
kernel's and XLA's are [K, N]. Each variant is checked first: Mosaic against the same W8A8 math in f32, Triton and
XLA against an f32 product with the dequantized weights. Past --budget-s seconds, the sweep shrinks to
its first configuration so the whole run stays short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_gemm import mosaic_gpu as mgpu
from pallas_kernels.fp8_gemm import gpu as triton_fp8

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
SMOKE_SHAPES = {"tiny": (512, 128)}
PEAK_BYTES_PER_S = 4.3e12
SWEEP = ((256, 4, 0), (128, 6, 0), (256, 4, 1), (128, 6, 1))  # (block_k, stages, splits; 0 = auto)


def _time(fn, x, ws, reps: int, runs: int):
    """(seconds per call of fn(x, w) over the weight copies ws, fn(x, ws[0])): reps calls of one jitted
    program queued back to back, median of runs."""
    program = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    first = jax.block_until_ready(program(x, ws))[0]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = [program(x, ws) for _ in range(reps)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times) / len(ws), first


def _rel_err(out, ref) -> float:
    out = np.asarray(out, np.float32)
    return float(np.linalg.norm(out - ref) / (np.linalg.norm(ref) + 1e-30))


def _weights(key, k: int, n: int):
    """Random weights quantized per output feature: q [N, K] fp8, w_scale [N] f32."""
    w = jax.random.normal(key, (n, k), jnp.float32) / np.sqrt(k)
    w_scale = jnp.max(jnp.abs(w), axis=1) / mgpu.FP8_MAX
    return (w / w_scale[:, None]).astype(mgpu.FP8), w_scale


def _copies(nbytes: int, smoke: bool) -> int:
    return 2 if smoke else max(2, min(64, (1 << 30) // nbytes))


def run(rows_list, shapes, sweep, smoke: bool, budget_s: float) -> list[dict]:
    start = time.perf_counter()
    reps, runs = (1, 1) if smoke else (10, 5)
    results = []
    for name, (k, n) in shapes.items():
        n8, n16 = _copies(k * n, smoke), _copies(2 * k * n, smoke)
        keys = jax.random.split(jax.random.key(0), max(n8, n16))
        fp8 = [_weights(key, k, n) for key in keys[:n8]]  # ([N, K] fp8, [N]): the Mosaic kernel's layout
        q0, s0 = fp8[0]
        w0 = q0.astype(jnp.float32) * s0[:, None]  # the dequantized weight [N, K]
        bf16 = [(_weights(key, k, n)[0].astype(jnp.float32) * s0[:, None]).T.astype(jnp.bfloat16)
                for key in keys[:n16]]
        bf16[0] = w0.T.astype(jnp.bfloat16)
        triton = [(q.T, s) for q, s in fp8]  # [K, N], as the engine stores fp8 weights
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            exact = np.asarray(jnp.matmul(x.astype(jnp.float32), w0.T, precision="highest"))
            w8a8 = np.asarray(mgpu.reference(x, q0, s0))
            row = {"shape": name, "k": k, "n": n, "rows": rows}

            def record(label, fn, ws, ref, nbytes, x=x):
                seconds, out = _time(fn, x, ws, reps, runs)
                err = _rel_err(out, ref)
                if err > 2e-2:
                    raise AssertionError(f"{name} rows={rows} {label}: relative error {err:.2e}")
                us = seconds * 1e6
                entry = {"us": us, "gb_per_s": nbytes / us / 1e3, "err": err}
                entry["share"] = entry["gb_per_s"] * 1e9 / PEAK_BYTES_PER_S
                return entry

            row["xla_bf16"] = record("xla bf16", lambda x, w: x @ w, bf16, exact, 2 * k * n)
            row["triton"] = record("triton", lambda x, w: triton_fp8.fp8_matmul(
                x, w[0], w[1], config=triton_fp8.TuningConfig(block_k=128, num_cores=4) if smoke else None,
                interpret=smoke), triton, exact, k * n)
            sweep_now = sweep if time.perf_counter() - start < budget_s else sweep[:1]
            configs = dict.fromkeys(mgpu.Fp8GemvConfig(bk, st, sp or mgpu.auto_splits(k, n, bk))
                                    for bk, st, sp in sweep_now if k % bk == 0)  # in order, deduplicated
            row["mosaic"] = []
            for config in configs:
                try:
                    mgpu.check_shapes(rows, k, n, config)
                    entry = record(str(config), lambda x, w, c=config: mgpu.fp8_gemv(
                        x, w[0], w[1], config=c, interpret=smoke), fp8, w8a8, k * n)
                except Exception as err:  # noqa: BLE001 - a configuration the compiler refuses is reported
                    print(f"  {name} rows={rows} {config}: {type(err).__name__}: {str(err)[:160]}", flush=True)
                    continue
                row["mosaic"].append({"config": vars(config), **entry})
            if row["mosaic"]:
                best = min(row["mosaic"], key=lambda e: e["us"])
                config = mgpu.Fp8GemvConfig(**best["config"])

                def kernel_only(xs, w, c=config):
                    out = mgpu.fp8_gemv_quantized(xs[0], xs[1], w[0], w[1], config=c, m=rows, interpret=smoke)
                    return out if c.splits == 1 else out.sum(axis=0).T[:rows].astype(jnp.bfloat16)

                row["kernel_only"] = {"config": best["config"], **record(
                    "kernel only", kernel_only, fp8, w8a8, k * n, x=mgpu.quantize_rows(x))}
            results.append(row)
            _print(row)
    return results


def _print(row) -> None:
    ref_us = row["xla_bf16"]["us"]

    def cell(e):
        return (f"{e['us']:7.2f} us {e['gb_per_s']:5.0f} GB/s {e['share']:4.0%} {ref_us / e['us']:4.2f}x bf16 "
                f"err {e['err']:.1e}")

    def short(c):
        return f"bk {c['block_k']} st {c['stages']} sp {c['splits']}"

    print(f"{row['shape']:8s} K {row['k']:5d} N {row['n']:5d} rows {row['rows']:2d}", flush=True)
    print(f"    {'xla bf16 dot':19s}{cell(row['xla_bf16'])}", flush=True)
    print(f"    {'triton fp8 (w8a16)':19s}{cell(row['triton'])}", flush=True)
    for e in sorted(row["mosaic"], key=lambda e: e["us"]):
        print(f"    {'mosaic w8a8':19s}{cell(e)}  {short(e['config'])}", flush=True)
    if "kernel_only" in row:
        e = row["kernel_only"]
        print(f"    {'mosaic kernel only':19s}{cell(e)}  {short(e['config'])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", help="decode rows, comma-separated (default 1,16,64; --smoke: 1,16)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="these shapes only")
    parser.add_argument("--configs", nargs="+", metavar="BK,STAGES,SPLITS",
                        help="the Mosaic kernel's sweep, SPLITS 0 = auto (default: SWEEP)")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="past this many seconds, time only the sweep's first configuration")
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny shape, the kernels interpreted")
    parser.add_argument("--json")
    args = parser.parse_args()
    sweep = tuple(tuple(int(v) for v in c.split(",")) for c in args.configs) if args.configs else SWEEP
    if args.smoke:
        shapes, sweep = SMOKE_SHAPES, ((128, 2, 0), (256, 2, 1))
    else:
        shapes = {name: SHAPES[name] for name in (args.shapes or SHAPES)}
    print(f"{jax.devices()[0].device_kind}: fp8 weight GEMMs against XLA's bf16 dot", flush=True)
    rows = args.rows or ("1,16" if args.smoke else "1,16,64")
    results = run([int(r) for r in rows.split(",")], shapes, sweep, args.smoke, args.budget_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
