"""Decode-sized GEMMs (M = 1 or 16 rows against a large weight) on one GPU: XLA's dot against a Pallas
Triton kernel that streams the weight with a split over K, for the per-device shapes of the Llama-3-8B
decode step at T=1 and T=2.

    python3 benchmarks/decode_gemm.py [--rows 16] [--tp 2] [--quick]

Each variant is jitted over enough distinct weight copies (~1 GB) that L2 holds none of them, timed as
the wall time of 10 calls queued back to back divided by calls and copies: the per-GEMM time including launch gaps, as a
decode step pays it. Bandwidth = weight bytes / time. Every variant is checked against a float32
product first (relative error). Prints the best kernel configuration per shape last.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# name: (K, N) of the full 8B model; tensor parallel divides N (column-parallel) or K (row-parallel).
SHAPES = {"qkv": (4096, 6144, "col"), "o": (4096, 4096, "row"), "gate_up": (4096, 28672, "col"),
          "down": (14336, 4096, "row")}


def _kernel(x_ref, w_ref, o_ref, *, block_k, num_k, w_nk):
    rows, bn = x_ref.shape[0], o_ref.shape[-1]

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[:, ks]
        if w_nk:
            return acc + lax.dot_general(x, w_ref[:, ks], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
        return acc + jnp.dot(x, w_ref[ks, :], preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((rows, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gemm(x, w, *, block_n, block_k, splits, w_nk=False, num_warps=4, num_stages=3):
    """x [M, K] @ w ([K, N], or [N, K] with w_nk) -> [M, N] in x's dtype (splits == 1) or float32
    partial sums [splits, M, N]."""
    rows, k = x.shape
    n = w.shape[0] if w_nk else w.shape[1]
    k_split = k // splits
    assert k % (splits * block_k) == 0 and n % block_n == 0, (k, n, splits, block_k, block_n)
    kernel = functools.partial(_kernel, block_k=block_k, num_k=k_split // block_k, w_nk=w_nk)
    w_spec = (pl.BlockSpec((block_n, k_split), lambda j, s: (j, s)) if w_nk
              else pl.BlockSpec((k_split, block_n), lambda j, s: (s, j)))
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
        out_spec = pl.BlockSpec((rows, block_n), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, rows, n), jnp.float32)
        out_spec = pl.BlockSpec((None, rows, block_n), lambda j, s: (s, 0, j))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((rows, k_split), lambda j, s: (0, s)), w_spec], out_specs=out_spec,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="decode_gemm", interpret=jax.default_backend() == "cpu",
    )(x, w)


def timed(fn, x, ws, reps=10):
    """Seconds per GEMM of fn over the weight copies: reps calls queued back to back (the device, not the
    host's dispatch, sets the pace), median of 5 such runs."""
    run = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(run(x, ws))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [run(x, ws) for _ in range(reps)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times) / len(ws)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--quick", action="store_true", help="a small sweep")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--xla-only", action="store_true", help="only XLA's dot (e.g. under other XLA_FLAGS)")
    parser.add_argument("--stages", type=int, nargs="+", default=[3])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    best_rows = []
    for tp, rows, name in itertools.product(args.tp, args.rows, args.shapes):
        k, n, kind = SHAPES[name]
        k, n = (k, n // tp) if kind == "col" else (k // tp, n)
        nbytes = k * n * 2
        copies = max(2, -(-1_000_000_000 // nbytes))
        w32 = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
        w = jnp.asarray(w32, jnp.bfloat16)
        ws = [w + 0 for _ in range(copies)]  # distinct buffers, same values
        ws_nk = [] if args.xla_only else [w.T + 0 for _ in range(copies)]
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)

        def err(out):
            out = np.asarray(out, np.float32)
            out = out.sum(0) if out.ndim == 3 else out
            return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))

        results = []
        xla = lambda x, w: x @ w
        results.append(("xla", err(jax.jit(xla)(x, w)), timed(xla, x, ws)))
        for s in (2, 4):
            split = lambda x, w, s=s: jnp.einsum("msk,skn->smn", x.reshape(rows, s, k // s),
                                                 w.reshape(s, k // s, n), preferred_element_type=jnp.float32)
            results.append((f"xla_split{s}", err(jax.jit(split)(x, w)), timed(split, x, ws)))
        block_ns = (32, 64, 128) if not args.quick else (64,)
        block_ks = (128, 256) if not args.quick else (256,)
        splits = (1, 2, 4) if not args.quick else (1, 4)
        configs = itertools.product(block_ns, block_ks, splits, (False, True), args.stages)
        for bn, bk, s, w_nk, stages in [] if args.xla_only else configs:
            if n % bn or k % (s * bk) or (w_nk and bn == 128):
                continue
            fn = functools.partial(gemm, block_n=bn, block_k=bk, splits=s, w_nk=w_nk, num_stages=stages)
            label = f"pallas bn={bn} bk={bk} s={s} {'nk' if w_nk else 'kn'} st={stages}"
            try:
                e = err(jax.jit(fn)(x, ws_nk[0] if w_nk else w))
                t = timed(fn, x, ws_nk if w_nk else ws)
            except Exception as exc:  # a config Triton rejects: report and go on
                print(f"  {label}: failed: {str(exc).splitlines()[0][:120]}", flush=True)
                continue
            results.append((label, e, t))
            if s > 1:  # the split sum as XLA does it after the kernel
                fs = lambda x, w, fn=fn: fn(x, w).sum(0).astype(x.dtype)
                results.append((label + " +sum", e, timed(fs, x, ws_nk if w_nk else ws)))
        print(f"\n== tp={tp} rows={rows} {name}: K={k} N={n} ({nbytes / 1e6:.1f} MB), {copies} copies", flush=True)
        for label, e, t in sorted(results, key=lambda r: r[2]):
            print(f"  {t * 1e6:8.2f} us {nbytes / t / 1e12:6.2f} TB/s  err {e:.1e}  {label}", flush=True)
        xla_t = results[0][2]
        ok = [r for r in results if r[0].startswith("pallas") and r[1] < 1e-2]
        best = min(ok, key=lambda r: r[2]) if ok else ("-", 0, float("nan"))
        best_rows.append(f"tp={tp} rows={rows} {name:8s} xla {xla_t * 1e6:7.2f} us ({nbytes / xla_t / 1e12:.2f} TB/s)"
                         f" | best {best[2] * 1e6:7.2f} us ({nbytes / best[2] / 1e12:.2f} TB/s) {best[0]}")
        del ws, ws_nk
    print(f"\n{jax.devices()[0].device_kind}: best per shape")
    print("\n".join(best_rows))


if __name__ == "__main__":
    main()
