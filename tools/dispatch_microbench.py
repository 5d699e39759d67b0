"""What a jitted call costs on the host per argument buffer, and what stacked-layer weights cost on device.

    PYTHONPATH=. python3 tools/dispatch_microbench.py [--part dispatch|stacked|all]

dispatch: host time of f(*args) (returns once enqueued) for N small arguments, made by device_put or
  by a jitted computation, on one device and sharded over every device, jit vs AOT-compiled.
stacked: device time of 32 layers of 8B-shape matmuls (qkv, o, gate_up, down) at M = 1, 16, 64 with
  one array per layer vs one [L, ...] array per weight indexed statically in an unrolled loop (does
  XLA copy the slices?).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _host_call_us(fn, args, iters=200):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return float(np.median(times) * 1e6)


def dispatch_part(rows):
    def body(*xs):
        return xs[0] + xs[-1]

    mesh = Mesh(np.array(jax.devices()), ("model",))
    for n in (10, 100, 300, 600):
        for place in ("single", "sharded"):
            if place == "sharded" and len(jax.devices()) == 1:
                continue
            sharding = (NamedSharding(mesh, P("model")) if place == "sharded"
                        else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            put = [jax.device_put(np.full((1024,), i, np.float32), sharding) for i in range(n)]
            made = jax.jit(lambda *xs: [x * 1 for x in xs], out_shardings=sharding)(*put)
            jax.block_until_ready(made)
            f = jax.jit(body)
            for origin, args in (("device_put", put), ("jit-made", made)):
                us = _host_call_us(f, args)
                aot = f.lower(*args).compile()
                us_aot = _host_call_us(aot, args)
                buffers = n * (len(jax.devices()) if place == "sharded" else 1)
                rows.append(("dispatch", f"n={n} {place} {origin}", f"jit {us:8.1f} us",
                             f"aot {us_aot:8.1f} us", f"{us / buffers:5.2f} us/buffer"))
                print(rows[-1], flush=True)


def stacked_part(rows, layers=32):
    d, f, q = 4096, 14336, 6144
    key = jax.random.key(0)
    shapes = {"qkv": (d, q), "o": (d, d), "gate_up": (d, 2 * f), "down": (f, d)}
    stacked = {k: jax.random.normal(key, (layers, *s), jnp.bfloat16) for k, s in shapes.items()}
    per_layer = [{k: jnp.copy(v[i]) for k, v in stacked.items()} for i in range(layers)]
    jax.block_until_ready(per_layer)

    def layer(x, w):
        h = x @ w["qkv"]
        x = x + h[:, :d] @ w["o"]
        gu = x @ w["gate_up"]
        return x + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ w["down"]

    @jax.jit
    def run_list(ws, x):
        for w in ws:
            x = layer(x, w)
        return x

    @jax.jit
    def run_stacked(ws, x):
        for i in range(layers):
            x = layer(x, {k: v[i] for k, v in ws.items()})
        return x

    weight_bytes = sum(v.size for v in stacked.values()) * 2
    for m in (1, 16, 64):
        x = jnp.ones((m, d), jnp.bfloat16)
        for name, fn, ws in (("list", run_list, per_layer), ("stacked", run_stacked, stacked)):
            out = fn(ws, x)
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for _ in range(20):
                out = fn(ws, x)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - t0) / 20 * 1e3
            rows.append(("stacked", f"M={m} {name}", f"{ms:7.3f} ms", f"{weight_bytes / ms / 1e9:6.2f} TB/s", ""))
            print(rows[-1], flush=True)
        hlo = run_stacked.lower(stacked, x).compile().as_text()
        copies = sum(1 for line in hlo.splitlines() if "slice" in line and "fusion" in line and "=" in line)
        rows.append(("stacked", f"M={m} hlo", f"{copies} slice-fusion lines", "", ""))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="all")
    args = parser.parse_args()
    rows = []
    print(jax.devices(), flush=True)
    if args.part in ("dispatch", "all"):
        dispatch_part(rows)
    if args.part in ("stacked", "all"):
        stacked_part(rows)
    print("\n| part | case | a | b | c |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
