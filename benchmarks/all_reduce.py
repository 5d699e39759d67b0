"""One-shot peer-memory all-reduce (pallas_kernels/all_reduce) vs XLA's psum on 2+ local GPUs.

    python3 benchmarks/all_reduce.py [--layers 32] [--width 4096] [--iters 50] [--graph-cost]

1. correctness: the kernel vs psum on random bf16/f32 inputs of several token counts, and a chain of
   2 x layers all-reduces (what one decode step does), bit-compared;
2. latency at batch 1 ([1, width] bf16): 2 x layers calls in one program, us per call, for psum, the
   kernel, XLA's psum + residual add + RMSNorm and the fused kernel;
3. a decode-step-shaped chain (per layer: [T, D] x [D, D] matmul + all-reduce, twice) jitted with each
   all-reduce: wall ms per call (steady state, calls queued back to back) and host ms per call
   (time until the call returns, which is what caps a decode loop when the device is fast).
Prints a table last.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.all_reduce import mosaic_gpu as ar


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--graph-cost", action="store_true", help="also the host cost of CUDA-graph updates")
    args = parser.parse_args()

    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("model",), devices=devices)
    spaces = {dtype: ar.Workspace(devices, dtype) for dtype in ("bfloat16", "float32")}
    tables = {dtype: ws.table(mesh, "model") for dtype, ws in spaces.items()}
    ws, table = spaces["bfloat16"], tables["bfloat16"]
    rows = []

    def sharded(shape, dtype, seed):
        x = np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)
        return jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, P("model")))

    def smap(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("model"), P("model")), out_specs=P("model"),
                                     check_vma=False))

    for dtype in ("bfloat16", "float32"):
        kernel_fn = smap(lambda x, t, layout=spaces[dtype].layout: ar.all_reduce(x, t, layout))
        psum_fn = smap(lambda x, t: jax.lax.psum(x, "model"))
        for tokens in (1, 8, 64):
            x = sharded((tokens, args.width), dtype, tokens)
            if x.size // n % spaces[dtype].layout.chunk:
                continue
            got = np.asarray(kernel_fn(x, tables[dtype]), np.float32)
            want = np.asarray(psum_fn(x, tables[dtype]), np.float32)
            rows.append((f"correct {dtype} T={tokens}", "identical" if np.array_equal(got, want)
                         else f"MAX DIFF {np.abs(got - want).max():.3g}"))

    # Latency: 2 x layers calls in one program (a decode step's worth), queued back to back: us per call.
    def latency(fn, *xs):
        y = fn(*xs)
        jax.block_until_ready(y)
        start = time.perf_counter()
        for _ in range(args.iters):
            y = fn(*xs)
        jax.block_until_ready(y)
        return (time.perf_counter() - start) / args.iters / (2 * args.layers) * 1e6

    def repeated(op, num_inputs):
        def fn(*xs):
            x, rest = xs[0], xs[1:]
            for _ in range(2 * args.layers):
                x = op(x, *rest)
            return x
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("model"),) * num_inputs, out_specs=P("model"),
                                     check_vma=False))

    from jaxserve.models.layers import rms_norm
    x1 = sharded((1, args.width), jnp.bfloat16, 11)
    w1 = sharded((args.width,), jnp.bfloat16, 12)
    for name, op, num in (
            ("psum", lambda x, t: jax.lax.psum(x, "model"), 2),
            ("one-shot kernel", lambda x, t: ar.all_reduce(x, t, ws.layout), 2),
            ("psum + residual add + rms_norm (XLA)",
             lambda x, w, t: rms_norm(x + jax.lax.psum(x, "model"), w[0], 1e-5), 3),
            ("fused kernel: all-reduce + add + rms_norm",
             lambda x, w, t: ar.all_reduce_rms_norm(x, x, w[0], 1e-5, t, ws.layout)[0], 3)):
        args_ = (x1, table) if num == 2 else (x1, w1, table)
        rows.append((f"latency [1, {args.width}] bf16, {name}: us per call", f"{latency(repeated(op, num), *args_):.2f}"))

    def chain(reduce):
        def fn(x, t):
            for _ in range(2 * args.layers):
                x = reduce(x, t) * 0.5
            return x
        return smap(fn)

    x = sharded((8, args.width), jnp.bfloat16, 7)
    got = np.asarray(chain(lambda x, t: ar.all_reduce(x, t, ws.layout))(x, table), np.float32)
    want = np.asarray(chain(lambda x, t: jax.lax.psum(x, "model"))(x, table), np.float32)
    rows.append((f"correct chain of {2 * args.layers}", "identical" if np.array_equal(got, want)
                 else f"MAX DIFF {np.abs(got - want).max():.3g}"))

    w = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((n, args.width, args.width)) * 0.01,
                                   jnp.bfloat16), NamedSharding(mesh, P("model")))

    def step(reduce, devices_mesh, layers, donate=False):
        def fn(x, w, t):
            w = w[0]
            for _ in range(2 * layers):
                x = reduce((x @ w).astype(x.dtype), t)
            return x
        # donate: the output reuses the input's buffer, so no address in the graph changes between calls
        return jax.jit(jax.shard_map(fn, mesh=devices_mesh, in_specs=(P("model"), P("model"), P("model")),
                                     out_specs=P("model"), check_vma=False), donate_argnums=(0,) if donate else ())

    def timed(fn, x, w, t):
        y = fn(x, w, t)
        y.block_until_ready()
        host = []
        start = time.perf_counter()
        for _ in range(args.iters):
            t0 = time.perf_counter()
            y = fn(y, w, t)
            host.append(time.perf_counter() - t0)
        y.block_until_ready()
        return (time.perf_counter() - start) / args.iters, float(np.median(host))

    # Host cost per graph node: the same chain without any all-reduce on one device and on all of
    # them (each launches its own graph), at two chain lengths; then with each all-reduce.
    one = jax.make_mesh((1,), ("model",), devices=devices[:1])
    for layers in (args.layers, 2 * args.layers) if args.graph_cost else ():
        for label, m in (("1 GPU", one), (f"{n} GPUs", mesh)):
            xs = jax.device_put(np.zeros((m.size * 8, args.width), np.float32).astype(jnp.bfloat16),
                                NamedSharding(m, P("model")))
            ws_ = jax.device_put(np.zeros((m.size, args.width, args.width), np.float32).astype(jnp.bfloat16),
                                 NamedSharding(m, P("model")))
            ts = jax.device_put(np.zeros((m.size, 2 + 2 * n), np.int32), NamedSharding(m, P("model")))
            for donate in (False, True):
                wall, host = timed(step(lambda x, t: x, m, layers, donate), xs, ws_, ts)
                xs = jax.device_put(np.zeros((m.size * 8, args.width), np.float32).astype(jnp.bfloat16),
                                    NamedSharding(m, P("model")))
                rows.append((f"no all-reduce, {label}, {2 * layers} matmuls{', donated' if donate else ''}: "
                             "wall/host ms", f"{wall * 1e3:.3f} / {host * 1e3:.3f}"))
    for name, reduce in (("psum", lambda x, t: jax.lax.psum(x, "model")),
                         ("one-shot kernel", lambda x, t: ar.all_reduce(x, t, ws.layout))):
        for donate in (False, True):
            wall, host = timed(step(reduce, mesh, args.layers, donate), x, w, table)
            x = sharded((8, args.width), jnp.bfloat16, 7)
            rows.append((f"step {name}{', donated' if donate else ''}: wall/host ms", f"{wall * 1e3:.3f} / {host * 1e3:.3f}"))

    print(f"\n{n} x {devices[0].device_kind}, {args.layers} layers x 2 all-reduces, width {args.width}")
    for key, value in rows:
        print(f"{key:<62} {value}")


if __name__ == "__main__":
    main()
