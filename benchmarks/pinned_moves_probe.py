"""How KV blocks should move between the device and pinned host memory: the host tier's way (a jitted
gather, then one batched device_put of its rows; a batched device_put back, then a jitted scatter) against
copies inside the jitted programs themselves (a gather whose outputs live in "pinned_host" memory; a scatter
whose row inputs do).

    python3 benchmarks/pinned_moves_probe.py [--blocks 512] [--block-kib 2048] [--chunk 64]

On one device, a cache of --blocks + 1 blocks ([blocks, row], bf16; a row is one block) and --blocks blocks
moved in programs of --chunk blocks:
    save/device_put   gather (device rows) -> jax.device_put(rows, pinned_host)
    save/in-program   gather with out_shardings in pinned_host
    load/device_put   jax.device_put(pinned rows, device) -> scatter
    load/in-program   scatter whose row arguments are pinned_host arrays (moved to the device inside it)
Per way: GB/s (best of 5, until the results are ready) and the host time of its calls alone. Then, with a
program (~100 ms on an H200) queued on the device first, the host time until each save way's calls return: a way whose
calls wait for the device stalls the engine's loop.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def _best(fn, repeats: int = 5) -> tuple[float, float]:
    """(best seconds until done, host seconds of the calls in that run) over `repeats` runs after a warm-up;
    fn() returns (its outputs, the host seconds of its calls)."""
    jax.block_until_ready(fn()[0])
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        start = time.perf_counter()
        out, host = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start, host))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--busy-size", type=int, default=8192, help="the busy program's matmul size (CPU: ~256)")
    args = parser.parse_args()
    device = jax.devices()[0]
    on_device = SingleDeviceSharding(device, memory_kind="device")
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    n, chunk, row = args.blocks, args.chunk, args.block_kib * 1024 // 2
    cache = jax.device_put(jnp.ones((n + 1, row), jnp.bfloat16), on_device)
    ids = [jnp.arange(1 + i, 1 + i + chunk, dtype=jnp.int32) for i in range(0, n, chunk)]
    nbytes = n * row * 2

    def rows_of(cache, ids):
        return tuple(cache[ids[i]] for i in range(chunk))

    gather = jax.jit(rows_of)
    gather_pinned = jax.jit(rows_of, out_shardings=(pinned,) * chunk)

    def write(cache, ids, *rows):
        return cache.at[ids].set(jnp.stack(rows))

    def write_from_host(cache, ids, *rows):
        return cache.at[ids].set(jnp.stack([jax.device_put(r, on_device) for r in rows]))

    scatter = jax.jit(write, donate_argnums=0)
    scatter_pinned = jax.jit(write_from_host, donate_argnums=0,
                             in_shardings=(on_device, on_device) + (pinned,) * chunk, out_shardings=on_device)
    saved = [jax.device_put(gather(cache, i), pinned) for i in ids]
    jax.block_until_ready(saved)

    def save_device_put():
        start, out = time.perf_counter(), []
        for i in ids:
            out.append(jax.device_put(gather(cache, i), pinned))
        return out, time.perf_counter() - start

    def save_in_program():
        start = time.perf_counter()
        out = [gather_pinned(cache, i) for i in ids]
        return out, time.perf_counter() - start

    def load_device_put():
        nonlocal cache
        start = time.perf_counter()
        for i, rows in zip(ids, saved):
            cache = scatter(cache, i, *jax.device_put(list(rows), on_device))
        return cache, time.perf_counter() - start

    def load_in_program():
        nonlocal cache
        start = time.perf_counter()
        for i, rows in zip(ids, saved):
            cache = scatter_pinned(cache, i, *rows)
        return cache, time.perf_counter() - start

    print(f"{device.device_kind}: {n} blocks of {args.block_kib} KiB, programs of {chunk}")
    for name, fn in [("save/device_put", save_device_put), ("save/in-program", save_in_program),
                     ("load/device_put", load_device_put), ("load/in-program", load_in_program)]:
        try:
            seconds, host = _best(fn)
        except Exception as err:  # noqa: BLE001 - a way XLA refuses is reported
            print(f"  {name:17s} failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        print(f"  {name:17s} {nbytes / seconds / 1e9:7.2f} GB/s  ({seconds * 1e3:7.2f} ms; calls {host * 1e3:7.2f} ms)")

    x = jnp.ones((args.busy_size, args.busy_size), jnp.bfloat16)
    busy = jax.jit(lambda x: jax.lax.fori_loop(0, 100, lambda i, y: (y @ x) * 1e-4, x))
    jax.block_until_ready(busy(x))
    for name, fn in [("save/device_put", save_device_put), ("save/in-program", save_in_program)]:
        try:
            jax.block_until_ready(busy(x))
            y = busy(x)
            cache = cache + y[0, 0].astype(cache.dtype) * 0  # the saves now wait for the busy program
            out, host = fn()
            jax.block_until_ready((out, y))
        except Exception as err:  # noqa: BLE001
            print(f"  busy device, {name}: failed: {type(err).__name__}")
            continue
        print(f"  busy device, {name}: calls returned after {host * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
