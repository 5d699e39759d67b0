"""Whether a host KV pool in pinned memory can be updated in place on this GPU: the question that decides
whether the KV tiers' host pool moves from pageable numpy to a "pinned_host" jax array.

    python3 benchmarks/pinned_pool_probe.py [--pool-gib 4] [--blocks 64] [--block-kib 2048]

On one device, with a pool of --pool-gib in "pinned_host" memory (blocks of --block-kib):
    update   a jitted, donated `pool.at[ids].set(blocks)` writing --blocks blocks from device memory: in place
             when its time is the blocks' bytes over the link, a whole-pool copy when it is the pool's
    read     the same blocks gathered from the pinned pool to the device
    numpy    the same bytes the way the tiers move them today: device -> np.asarray (pageable) and
             jax.device_put(numpy) back
    pinned   a plain device_put of the blocks to and from pinned_host (the link's ceiling)
Prints GB/s per row and whether the update is in place (its time under twice that of the pinned copy).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool-gib", type=float, default=4.0)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=2048)
    args = parser.parse_args()
    device = jax.devices()[0]
    kinds = device.addressable_memories() if hasattr(device, "addressable_memories") else []
    if "pinned_host" not in [m.kind for m in kinds]:
        print(f"{device.platform}: no pinned_host memory ({[m.kind for m in kinds]}); nothing to probe")
        return
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = SingleDeviceSharding(device)
    block_elems = args.block_kib * 1024 // 2
    num_blocks = int(args.pool_gib * (1 << 30) // (block_elems * 2))
    pool = jax.device_put(np.zeros((num_blocks, block_elems), np.float16), pinned)
    blocks = jax.device_put(jnp.ones((args.blocks, block_elems), jnp.float16), on_device)
    ids = jax.device_put(np.arange(0, num_blocks, num_blocks // args.blocks)[: args.blocks].astype(np.int32),
                         pinned)  # (an index into a pinned array lives in the same memory space)
    nbytes = args.blocks * block_elems * 2

    update = jax.jit(lambda pool, ids, blocks: pool.at[ids].set(jax.device_put(blocks, pinned)),
                     donate_argnums=0, out_shardings=pinned)
    gather = jax.jit(lambda pool, ids: jax.device_put(pool[ids], on_device))
    state = {"pool": pool}

    def do_update():
        state["pool"] = update(state["pool"], ids, blocks)
        state["pool"].block_until_ready()

    rows = {
        "update (pinned pool, donated)": _best(do_update),
        "read (pinned pool -> device)": _best(lambda: gather(state["pool"], ids).block_until_ready()),
        "numpy: device -> host": _best(lambda: np.asarray(blocks)),
        "numpy: host -> device": _best(lambda: jax.device_put(np.asarray(blocks), on_device).block_until_ready()),
        "pinned: device -> host": _best(lambda: jax.device_put(blocks, pinned).block_until_ready()),
    }
    host_copy = jax.device_put(blocks, pinned)
    rows["pinned: host -> device"] = _best(lambda: jax.device_put(host_copy, on_device).block_until_ready())
    print(f"{device.device_kind}: pool {args.pool_gib} GiB ({num_blocks} blocks of {args.block_kib} KiB), "
          f"{args.blocks} blocks = {nbytes / 2**20:.0f} MiB moved")
    for name, seconds in rows.items():
        print(f"  {name:32s} {seconds * 1e3:8.2f} ms  {nbytes / seconds / 1e9:7.2f} GB/s")
    in_place = rows["update (pinned pool, donated)"] < 2 * rows["pinned: device -> host"]
    print(f"update in place: {'yes' if in_place else 'no (it costs like a copy of the whole pool)'}")


if __name__ == "__main__":
    main()
