"""Decode GEMMs on Hopper's TMA + wgmma (Mosaic GPU) against XLA's, for the per-device shapes of the
Llama-3-8B decode step: are the first blocks of a persistent decode-layer kernel as fast as XLA's GEMMs?

    python3 benchmarks/decode_gemv_mgpu.py [--rows 16] [--tp 2]        (H100/H200)
    python3 benchmarks/decode_gemv_mgpu.py --swiglu [--tp 1 2]          (gate_up_swiglu against XLA)
    python3 benchmarks/decode_gemv_mgpu.py --check                      (CPU: GPU interpret mode)

The kernels are `benchmarks/experimental/decode_gemm/mosaic_gpu.py`'s: `gemv` (x [M, K] @ w [N, K].T, float32
partial sums per K split, not summed) and `gate_up_swiglu` (silu(x @ w_gate) * (x @ w_up) on [K, N]
weights, SwiGLU in the epilogue; the unfused ops are its reference).

Timing as in `decode_gemm.py` (~1 GB of weight copies, 10 calls queued back to back): the per-GEMM time
including launch gaps, as a decode step pays it. XLA's dot includes its split-K sum; the kernel's
partial sums are not summed (say so when comparing).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.experimental.decode_gemm.mosaic_gpu import TILE_N, GemvConfig, gate_up_swiglu, gemv, swiglu_reference


def check() -> None:
    """The kernels in GPU interpret mode (CPU) against a float32 product (gemv) and the unfused ops
    (gate_up_swiglu, within one rounding of the dtype), small shapes."""
    rng = np.random.default_rng(0)
    for rows, k, n, config in ((16, 512, 128, GemvConfig(128, 1, 2)), (16, 512, 128, GemvConfig(128, 2, 2)),
                               (8, 256, 64, GemvConfig(64, 1, 3)), (16, 512, 128, GemvConfig(128, 1, 2, False))):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
        out = np.asarray(gemv(x, w, config, interpret=True)).sum(0).T
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        print(f"rows={rows} K={k} N={n} {config}: relative error {err:.1e}")
        assert err < 1e-2, err
    for rows, k, n, config in ((16, 512, 128, GemvConfig(128, 1, 2)), (8, 256, 64, GemvConfig(64, 1, 3))):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w_gate, w_up = (jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(2))
        out = np.asarray(gate_up_swiglu(x, w_gate, w_up, config, interpret=True), np.float32)
        ref = np.asarray(swiglu_reference(x, w_gate, w_up), np.float32)
        diff = float(np.abs(out - ref).max())
        print(f"gate_up_swiglu rows={rows} K={k} N={n} {config}: max |diff| {diff:.3f} (max |ref| "
              f"{float(np.abs(ref).max()):.2f})")
        assert diff <= 2 ** -7 * max(1.0, float(np.abs(ref).max())), diff


def time_swiglu(tps, rows_list) -> None:
    """gate_up_swiglu against the unfused ops (XLA), at the per-device gate/up shapes of Llama-3-8B."""
    from benchmarks.decode_gemm import timed  # noqa: PLC0415 (the shared timing)
    rng = np.random.default_rng(0)
    lines = []
    for tp, rows in itertools.product(tps, rows_list):
        k, n = 4096, 14336 // tp
        nbytes = 2 * k * n * 2
        copies = max(2, -(-1_000_000_000 // nbytes))
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(2)]
        ref = np.asarray(swiglu_reference(x, *w), np.float32)
        ws = [(w[0] + 0, w[1] + 0) for _ in range(copies)]
        xla_t = timed(lambda x, w: swiglu_reference(x, *w), x, ws)
        results = []
        for bk, stages in ((64, 4), (64, 8), (128, 2), (128, 3), (128, 4), (256, 2)):
            config = GemvConfig(bk, 1, stages)
            fn = lambda x, w, config=config: gate_up_swiglu(x, *w, config)
            try:
                err = float(np.abs(np.asarray(jax.jit(fn)(x, ws[0]), np.float32) - ref).max())
                results.append((timed(fn, x, ws), err, config))
            except Exception as exc:  # a config Mosaic rejects: report and go on
                print(f"  {config}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
        del ws
        print(f"\n== tp={tp} rows={rows} gate/up + SwiGLU: K={k} N={n} x 2 ({nbytes / 1e6:.1f} MB), {copies} "
              f"copies; XLA {xla_t * 1e6:.2f} us ({nbytes / xla_t / 1e12:.2f} TB/s)", flush=True)
        for t, err, config in sorted(results, key=lambda r: r[0]):
            print(f"  {t * 1e6:8.2f} us {nbytes / t / 1e12:6.2f} TB/s  max|diff| {err:.3f}  {config}", flush=True)
        if results:
            t, err, config = min(results, key=lambda r: r[0])
            lines.append(f"tp={tp} rows={rows} gate/up+swiglu xla {xla_t * 1e6:7.2f} us | mosaic {t * 1e6:7.2f} us "
                         f"({nbytes / t / 1e12:.2f} TB/s, max|diff| {err:.3f}) block_k={config.block_k} "
                         f"stages={config.stages}")
    print(f"\n{jax.devices()[0].device_kind}: XLA's gate/up GEMMs + SwiGLU vs the fused Mosaic GPU kernel")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--check", action="store_true", help="GPU interpret mode on the CPU, small shapes")
    parser.add_argument("--shapes", nargs="+", default=None, help="default: all of decode_gemm.SHAPES")
    parser.add_argument("--configs", nargs="+", default=None, metavar="BK,SPLITS,STAGES,INPLACE",
                        help="configs to time (e.g. 128,1,8,1) instead of the sweep")
    parser.add_argument("--swiglu", action="store_true",
                        help="time gate_up_swiglu against XLA's gate/up GEMMs and SwiGLU product instead")
    args = parser.parse_args()
    if args.check:
        check()
        return
    if args.swiglu:
        time_swiglu(args.tp, args.rows)
        return
    from benchmarks.decode_gemm import SHAPES, timed  # noqa: PLC0415 (the shared timing)
    rng = np.random.default_rng(0)
    lines = []
    if args.configs:
        fields = [[int(v) for v in c.split(",")] for c in args.configs]  # BK,SPLITS,STAGES[,INPLACE]
        configs = [GemvConfig(*f[:3], *(bool(v) for v in f[3:4])) for f in fields]
    else:
        configs = [GemvConfig(bk, splits, stages)
                   for bk, splits, stages in itertools.product((128, 256), (1, 2, 4), (4, 8))]
    for tp, rows, name in itertools.product(args.tp, args.rows, args.shapes or SHAPES):
        k, n, kind = SHAPES[name]
        k, n = (k, n // tp) if kind == "col" else (k // tp, n)
        nbytes = k * n * 2
        copies = max(2, -(-1_000_000_000 // nbytes))
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w_kn = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        ref = np.asarray(x, np.float32) @ np.asarray(w_kn, np.float32)
        ws_kn = [w_kn + 0 for _ in range(copies)]
        xla_t = timed(lambda x, w: x @ w, x, ws_kn)
        del ws_kn
        ws_nk = [w_kn.T + 0 for _ in range(copies)]
        results = []
        for config in configs:
            smem = config.stages * (rows + TILE_N) * config.block_k * 2 + TILE_N * rows * 4
            if k % (config.splits * config.block_k) or smem > 200_000:
                continue
            fn = functools.partial(gemv, config=config)
            try:
                out = np.asarray(jax.jit(fn)(x, ws_nk[0])).sum(0).T
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                t = timed(fn, x, ws_nk)
            except Exception as exc:  # a config Mosaic rejects: report and go on
                print(f"  {config}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
                continue
            results.append((t, err, config))
        del ws_nk
        print(f"\n== tp={tp} rows={rows} {name}: K={k} N={n} ({nbytes / 1e6:.1f} MB), {copies} copies; "
              f"XLA {xla_t * 1e6:.2f} us ({nbytes / xla_t / 1e12:.2f} TB/s)", flush=True)
        for t, err, config in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  {t * 1e6:8.2f} us {nbytes / t / 1e12:6.2f} TB/s  err {err:.1e}  {config}", flush=True)
        if results:
            t, err, config = min(results, key=lambda r: r[0])
            lines.append(f"tp={tp} rows={rows} {name:8s} xla {xla_t * 1e6:7.2f} us | mosaic {t * 1e6:7.2f} us "
                         f"({nbytes / t / 1e12:.2f} TB/s, err {err:.0e}) {config}")
    print(f"\n{jax.devices()[0].device_kind}: XLA's dot (with its split-K sum) vs the Mosaic GPU kernel "
          "(partial sums, not summed)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
