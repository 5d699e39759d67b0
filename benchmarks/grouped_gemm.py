"""Grouped GEMM for MoE experts: our Mosaic GPU kernel against `lax.ragged_dot` and the all-experts dense
einsum, at the Qwen3-30B-A3B expert shapes (128 experts, top-8; gate/up K 2048 -> N 1536, down
K 768 -> N 2048), bf16, for 1, 8, 64, 512 and 4096 tokens (T*8 rows sorted by expert).

    python3 benchmarks/grouped_gemm.py [--tokens 1 8 64 512 4096] [--proj gate_up down] [--sweep]

Each method runs `reps` times inside one jit over 12 weight copies (a decode's touched
experts fit in L2; the copies keep every call's weights cold), and the time per call is the
difference between 12 and 4 calls per jit divided by 8 (the jit dispatch cancels; the per-kernel
launch gaps stay in, as a decode step pays them). Routing: each token picks 8 distinct experts
uniformly. "touched TB/s": the bytes of the experts some row was routed to (each read once) plus
lhs and out, over the time. Every method's output is checked against `ragged_dot` in float32
(relative Frobenius error). The dense einsum computes every expert on every token (the combine
weights folded in for down), so its output differs in shape and is not checked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_gemm import gpu, reference

EXPERTS, TOP_K = 128, 8
PROJ = {"gate_up": (2048, 1536), "down": (768, 2048)}
COPIES = 12  # one weight copy per call in a timed jit: no two calls are the same computation


def routing(tokens: int, rng) -> np.ndarray:
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
    return np.bincount(ids.ravel(), minlength=EXPERTS).astype(np.int32)


def timed(fn, args_for, reps_lo=4, reps_hi=12, repeats=3) -> tuple[float, float]:
    """Seconds per call: (time of reps_hi calls - time of reps_lo calls) / (reps_hi - reps_lo), and the
    time of reps_hi calls / reps_hi (dispatch included: an upper bound)."""
    def batch(reps):
        def run(*copies):
            return jnp.stack([jax.lax.optimization_barrier(fn(*args_for(copies, i)))[0, :8].astype(jnp.float32)
                              for i in range(reps)])
        return jax.jit(run)

    out = {}
    for reps in (reps_lo, reps_hi):
        f = batch(reps)
        f(*COPY_ARGS).block_until_ready()
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            f(*COPY_ARGS).block_until_ready()
            samples.append(time.perf_counter() - t)
        out[reps] = statistics.median(samples)
    return (out[reps_hi] - out[reps_lo]) / (reps_hi - reps_lo), out[reps_hi] / reps_hi


COPY_ARGS: tuple = ()


def sweep_configs(m: int, sweep: bool):
    default = gpu.default_config(m, 0, 0, EXPERTS)
    if not sweep:
        return [default]
    mean = m / EXPERTS
    if mean <= 12:
        cands = [gpu.GpuConfig(bm, bn, bk, st, c) for bm, bn, bk, st, c in
                 ((8, 64, 128, 6, 264), (32, 64, 128, 6, 264), (16, 64, 128, 4, 132), (16, 64, 256, 4, 264))]
    else:
        cands = [gpu.GpuConfig(bm, bn, bk, st, c) for bm, bn, bk, st, c in
                 ((64, 128, 64, 4, 132), (128, 128, 64, 4, 132), (128, 64, 64, 4, 264), (64, 64, 128, 4, 264))]
    return [default] + [c for c in cands if c != default]


def main() -> None:
    global COPY_ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    ap.add_argument("--proj", nargs="+", default=list(PROJ))
    ap.add_argument("--sweep", action="store_true", help="time several GpuConfigs per shape")
    ap.add_argument("--no-dense", action="store_true")
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rng = np.random.default_rng(0)
    rows_out = []
    for proj in args.proj:
        k, n = PROJ[proj]
        key = jax.random.key(1)
        weights = [jax.random.normal(jax.random.fold_in(key, c), (EXPERTS, k, n), jnp.float32).astype(jnp.bfloat16)
                   for c in range(COPIES)]
        for tokens in args.tokens:
            sizes_np = routing(tokens, rng)
            m = tokens * TOP_K
            sizes = jnp.asarray(sizes_np)
            lhs = jax.random.normal(jax.random.fold_in(key, 100 + tokens), (m, k), jnp.bfloat16)
            COPY_ARGS = tuple(weights)
            touched = int((sizes_np > 0).sum())
            nbytes = touched * k * n * 2 + m * k * 2 + m * n * 2
            flops = 2 * m * k * n
            truth = np.asarray(jax.jit(lambda a, b, s: jax.lax.ragged_dot(
                a.astype(jnp.float32), b.astype(jnp.float32), s,
                precision=jax.lax.Precision.HIGHEST))(lhs, weights[0], sizes))

            def err_of(fn):
                out = np.asarray(jax.jit(fn)(lhs, weights[0], sizes), np.float32)
                return float(np.linalg.norm(out - truth) / np.linalg.norm(truth))

            results = []
            rd = lambda a, b, s: reference.ragged_dot(a, b, s)  # noqa: E731
            t_rd, _ = timed(rd, lambda cs, i: (lhs, cs[i % COPIES], sizes))
            results.append(("ragged_dot", t_rd, err_of(rd)))
            for cfg in sweep_configs(m, args.sweep):
                fn = lambda a, b, s, cfg=cfg: gpu.grouped_matmul(a, b, s, cfg)  # noqa: E731
                try:
                    t, t_up = timed(fn, lambda cs, i: (lhs, cs[i % COPIES], sizes))
                    results.append((f"pallas {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.stages} c{cfg.ctas}",
                                    t, err_of(fn)))
                    print(f"  ({proj} T={tokens} {cfg}: {t_up * 1e3:.4f} ms per call with dispatch)")
                except Exception as e:  # noqa: BLE001 (a config over SMEM etc.: report, go on)
                    print(f"  {proj} T={tokens} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
            if not args.no_dense:
                x_tok = lhs[:tokens]
                if proj == "gate_up":
                    dense = lambda x, w: jnp.einsum("tk,ekn->ten", x, w)  # noqa: E731
                    dense_in = x_tok
                else:
                    comb = jax.random.uniform(key, (tokens, EXPERTS), jnp.bfloat16)
                    dense = lambda h, w: jnp.einsum("tek,ekn,te->tn", h, w, comb)  # noqa: E731
                    dense_in = jax.random.normal(key, (tokens, EXPERTS, k), jnp.bfloat16)
                t, _ = timed(lambda a, b, s: dense(a, b).reshape(tokens, -1), lambda cs, i: (dense_in, cs[i % COPIES], None))
                results.append(("dense all experts", t, float("nan")))
            for name, t, err in results:
                line = (f"{proj:8s} T={tokens:5d} rows={m:6d} experts={touched:3d} {name:36s} {t * 1e3:8.4f} ms "
                        f"{nbytes / t / 1e12:5.2f} TB/s {flops / t / 1e12:6.1f} TFLOP/s x{t_rd / t:6.2f} vs ragged_dot "
                        f"err {err:.1e}")
                print(line, flush=True)
                rows_out.append(line)
    print("\n=== summary ===")
    for proj in args.proj:
        for tokens in args.tokens:
            mine = [r for r in rows_out if r.startswith(f"{proj:8s} T={tokens:5d}") and "pallas" in r]
            best = min(mine, key=lambda r: float(r.split(" ms")[0].split()[-1])) if mine else None
            for r in rows_out:
                if r.startswith(f"{proj:8s} T={tokens:5d}") and ("pallas" not in r or r is best or r == mine[0]):
                    print(r)


if __name__ == "__main__":
    main()
