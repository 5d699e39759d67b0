"""Does a small host -> device argument hold the calling thread while other host -> device traffic is in
flight? The host time of two calls shaped as a PD decode instance's (a donated 32-layer scatter of one
install piece: block ids from numpy, already on the device, or in pinned host memory moved inside the
program; a step's staging: a 4 KiB int32 buffer from numpy or from pinned host memory) and of a plain small
device_put, alone and while a background thread moves large arrays onto the device (a pageable device_put
loop; a transfer-server pull loop on loopback, as the decode instance's pulls).

    PYTHONPATH=. python3 benchmarks/experimental/h2d_contention.py [--mib 256] [--calls 300]
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


def percentiles(samples: list[float]) -> str:
    a = np.asarray(samples) * 1e3
    return (f"p50 {np.percentile(a, 50):7.3f}  p90 {np.percentile(a, 90):7.3f}  p99 {np.percentile(a, 99):7.3f}"
            f"  max {a.max():7.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(device.device_kind, jax.__version__)
    on_device = jax.sharding.SingleDeviceSharding(device)
    kinds = [m.kind for m in device.addressable_memories()]
    pinned = on_device.with_memory_kind("pinned_host") if "pinned_host" in kinds else None

    caches = [jnp.zeros((2048, 16, 8, 128), jnp.bfloat16, device=device) for _ in range(32)]  # 32 x 64 MiB
    chunk = jnp.ones((16, 16, 8, 128), jnp.bfloat16, device=device)
    scatter = jax.jit(lambda cs, ids, x: [c.at[ids].set(x) for c in cs], donate_argnums=0)
    stage = jax.jit(lambda packed: packed * 2)
    ids_host = np.arange(16, 32, dtype=np.int32)
    packed_host = np.arange(1024, dtype=np.int32)
    ids_device = jax.device_put(ids_host, device)
    calls = {
        "scatter, ids numpy": lambda cs: scatter(cs, ids_host, chunk),
        "scatter, ids on device": lambda cs: scatter(cs, ids_device, chunk),
        "stage, numpy": lambda cs: (stage(packed_host), cs)[1],
        "device_put 4 KiB": lambda cs: (jax.device_put(packed_host, device), cs)[1],
    }
    if pinned is not None:
        scatter_pinned = jax.jit(lambda cs, ids, x: [c.at[jax.device_put(ids, on_device)].set(x) for c in cs],
                                 donate_argnums=0, in_shardings=([on_device] * 32, pinned, on_device),
                                 out_shardings=[on_device] * 32)
        stage_pinned = jax.jit(lambda packed: jax.device_put(packed, on_device) * 2, in_shardings=pinned,
                               out_shardings=on_device)
        calls["scatter, ids pinned host"] = lambda cs: scatter_pinned(cs, jax.device_put(ids_host, pinned), chunk)
        calls["stage, pinned host"] = lambda cs: (stage_pinned(jax.device_put(packed_host, pinned)), cs)[1]
    for call in calls.values():
        caches = call(caches)
    jax.block_until_ready(caches)

    stop = threading.Event()
    big = np.ones(args.mib << 20, np.uint8)

    def put_loop():
        while not stop.is_set():
            jax.device_put(big, device).block_until_ready()

    def pull_loop():
        from jaxserve.pd.device_transfer import DeviceEndpoint
        a, b = DeviceEndpoint(device, "127.0.0.1"), DeviceEndpoint(device, "127.0.0.1")
        pieces = [jnp.ones((16, 2 << 20), jnp.uint8, device=device) for _ in range(max(1, args.mib // 32))]
        while not stop.is_set():
            b.pull(a.address, a.offer(pieces), [16] * len(pieces), (2 << 20,), np.dtype(np.uint8),
                   time.monotonic() + 60)

    rows = []
    for background in (None, put_loop, pull_loop):
        stop.clear()
        thread = None
        if background is not None:
            thread = threading.Thread(target=background, daemon=True)
            thread.start()
            time.sleep(1.0)
        for label, call in calls.items():
            times = []
            for _ in range(args.calls):
                jax.block_until_ready(caches)
                started = time.perf_counter()
                caches = call(caches)
                times.append(time.perf_counter() - started)
                time.sleep(0.002)
            rows.append((background.__name__ if background else "idle", label, percentiles(times)))
        stop.set()
        if thread is not None:
            thread.join(timeout=30)
    print("== host time of the call (dispatch only)")
    for row in rows:
        print(f"{row[0]:10s} {row[1]:26s} {row[2]}")


if __name__ == "__main__":
    main()
