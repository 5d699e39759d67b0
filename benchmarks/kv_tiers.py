"""KV cache tiers on one device: block copy bandwidth through kv_transfer's own programs, and a multi-turn
workload with the host tier on and off.

    copy   an Engine of --config with a host tier; --copy-blocks blocks moved device -> host (the save path:
           KVTransfer.run's gather and copy to host -- pinned host arrays on a GPU, numpy elsewhere -- then
           poll() landing them in the host pool) and host -> device (the load path: the host pool's blocks
           copied to the device and scattered into every layer's cache, until the device is done), best of
           --repeats, in GB/s and blocks/s; beside them a plain copy of the same bytes: jax.device_put of a
           numpy array to the device and np.asarray back, and to and from "pinned_host" memory on a GPU. The
           ratio to the plain pinned copy is the share of the link kv_transfer reaches. Then a round trip of
           random K/V (saved from some blocks, loaded into others) checks the moves copy every byte.
    turns  --conversations conversations of --prompt-len random tokens; turn 1 generates --output-len tokens,
           turn 2 is turn 1's prompt and answer plus --append-len new tokens. Every first turn runs, then every
           second turn, on a device pool of --num-blocks (default: a third of the working set), so the second
           turns' prefixes were evicted from the device: with the host tier on they come back from host memory,
           off they are recomputed. Per setting: TTFT of the second turns, total tokens/s of both turns, each
           turn's seconds, prefix hit rate and host hits; then the ratios (on / off).

    python benchmarks/kv_tiers.py --config configs/llama3-8b-dummy.yaml --output-json kv_tiers.json   (H200)
    python benchmarks/kv_tiers.py --smoke                               (CPU: the embedded model, small sizes)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxserve.bench import common
from jaxserve.config import EngineConfig, load_config
from jaxserve.core.kv_tiers.link import Transfers
from jaxserve.engine import Engine
from jaxserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def _best(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn (after one untimed warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(config: EngineConfig, num_blocks: int, repeats: int) -> dict[str, Any]:
    """Device <-> host block moves through kv_transfer, and plain copies of the same bytes."""
    engine = Engine(config, progress=False)
    transfer, link = engine.kv_transfer, engine.kv_cache.tier_link
    host = transfer.tiers.host
    block_bytes = host.block_bytes
    num_blocks = min(num_blocks, engine.runner.num_blocks - 1, host.num_slots)
    block_ids = list(range(1, num_blocks + 1))
    keys = [i.to_bytes(32, "little") for i in block_ids]

    def save():
        for key in keys:
            if host.state(key) == "present":
                host.discard(key)
            host.reserve(key)
        transfer.run(Transfers(block_ids, keys, [], None))
        transfer.poll(link, wait=True)

    def load():
        data = host.blocks([host.lookup(key) for key in keys])  # (as take() hands them over)
        transfer.run(Transfers([], [], block_ids, data))
        jax.block_until_ready(engine.runner.kv_caches)

    save_s = _best(save, repeats)
    load_s = _best(load, repeats)
    total = num_blocks * block_bytes
    device = engine.runner.kv_caches[0].devices().pop()
    data = np.ones((num_blocks, *host.block_shape), host.dtype)
    on_device = jax.device_put(data, device)
    plain = {"host_to_device_s": _best(lambda: jax.device_put(data, device).block_until_ready(), repeats),
             "device_to_host_s": _best(lambda: np.asarray(on_device + 0), repeats)}
    if device.platform == "gpu" and "pinned_host" in [memory.kind for memory in device.addressable_memories()]:
        pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
        in_device = SingleDeviceSharding(device, memory_kind="device")  # a bare Device keeps the memory kind
        on_pinned = jax.device_put(data, pinned)
        plain["pinned_to_device_s"] = _best(lambda: jax.device_put(on_pinned, in_device).block_until_ready(),
                                            repeats)
        plain["device_to_pinned_s"] = _best(lambda: jax.device_put(on_device, pinned).block_until_ready(), repeats)
    report = {"block_bytes": block_bytes, "num_blocks": num_blocks, "bytes": total,
              "host_blocks": "pinned_host arrays" if transfer.pinned is not None else "numpy",
              **{direction: {"seconds": seconds, "gb_per_s": total / seconds / 1e9,
                             "blocks_per_s": num_blocks / seconds}
                 for direction, seconds in (("device_to_host", save_s), ("host_to_device", load_s))},
              "plain_gb_per_s": {name[:-2]: total / seconds / 1e9 for name, seconds in plain.items()}}
    for direction, ceiling in (("device_to_host", "device_to_pinned"), ("host_to_device", "pinned_to_device")):
        if ceiling in report["plain_gb_per_s"]:
            report[direction]["share_of_pinned_copy"] = (report[direction]["gb_per_s"]
                                                         / report["plain_gb_per_s"][ceiling])
    report["round_trip_exact"] = _round_trip_exact(engine, min(num_blocks, (engine.runner.num_blocks - 1) // 2))
    engine.close()
    return report


def _round_trip_exact(engine: Engine, count: int) -> bool:
    """Random K/V written into blocks 1..count of the target's caches, saved to host under fresh keys and
    loaded back into blocks count+1..2*count: whether every layer's copies equal the originals."""
    transfer, link = engine.kv_transfer, engine.kv_cache.tier_link
    host, axis = transfer.tiers.host, transfer.sets[0].axis
    keys = [(-1 - i).to_bytes(32, "little", signed=True) for i in range(count)]

    @functools.partial(jax.jit, donate_argnums=0)
    def fill_random(cache, seed):
        shape = list(cache.shape)
        shape[axis] = count
        noise = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(cache.dtype)
        return jax.lax.dynamic_update_slice_in_dim(cache, noise, 1, axis)

    engine.runner.kv_caches = [fill_random(cache, i) for i, cache in enumerate(engine.runner.kv_caches)]
    for key in keys:
        host.reserve(key)
    transfer.run(Transfers(list(range(1, count + 1)), keys, [], None))
    transfer.poll(link, wait=True)
    data = host.blocks([host.lookup(key) for key in keys])
    transfer.run(Transfers([], [], list(range(count + 1, 2 * count + 1)), data))
    same = [jnp.array_equal(jax.lax.slice_in_dim(c, 1, count + 1, axis=axis),
                            jax.lax.slice_in_dim(c, count + 1, 2 * count + 1, axis=axis))
            for c in engine.runner.kv_caches]
    return bool(all(bool(x) for x in same))


def multi_turn(config: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Both turns of every conversation on one engine of `config`; the second turns' figures."""
    engine, _ = common.make_engine(config, progress=False)
    rng = np.random.default_rng(args.seed)
    vocab = engine.vocab_size
    first_prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    first = common.run_batch(engine, [{"prompt_token_ids": p} for p in first_prompts], [params] * len(first_prompts),
                             progress=False, desc="turn 1")
    before = engine.stats().kv_cache
    second_prompts = [p + out.outputs[0].token_ids + rng.integers(3, vocab, args.append_len).tolist()
                      for p, out in zip(first_prompts, first.outputs)]
    second = common.run_batch(engine, [{"prompt_token_ids": p} for p in second_prompts],
                              [params] * len(second_prompts), progress=False, desc="turn 2")
    after = engine.stats().kv_cache
    tokens = sum(len(p) + args.output_len for p in first_prompts + second_prompts)
    queries = after.queries - before.queries
    report = {"turn2_ttft_ms": common.request_report(second.outputs)["ttft_ms"],
              "turn1_ttft_ms": common.request_report(first.outputs)["ttft_ms"],
              "total_tokens_per_s": tokens / (first.elapsed_s + second.elapsed_s),
              "turn1_s": first.elapsed_s, "turn2_s": second.elapsed_s,
              "turn2_hit_rate": (after.hits - before.hits) / queries if queries else 0.0,
              "turn2_host_hits": after.host_hits - before.host_hits,
              "num_preemptions": engine.stats().num_preemptions, "swaps_out": after.swaps_out,
              "kv_cache": common.kv_cache_report(engine), "num_kv_blocks": engine.runner.num_blocks}
    engine.close()
    del engine
    gc.collect()
    return report


def kv_block_bytes(config: EngineConfig) -> int:
    """One KV block's bytes (every layer's K and V) from the checkpoint's config.json and the dtype."""
    hf = json.loads((Path(config.model.path) / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    dtype = config.model.dtype if config.model.dtype != "auto" else hf.get("torch_dtype", "float32")
    itemsize = np.dtype({"bfloat16": "float16"}.get(dtype, dtype)).itemsize
    kv_heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    return hf["num_hidden_layers"] * 2 * config.cache.block_size * kv_heads * head_dim * itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "llama3-8b-dummy.yaml")
    parser.add_argument("--smoke", action="store_true", help="the embedded model at small sizes (CPU, seconds)")
    parser.add_argument("--copy-blocks", type=int, default=512, help="blocks per timed move")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--append-len", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, help="device KV pool (default: a third of the working set)")
    parser.add_argument("--host-kv-gib", type=float, help="host tier when on (default: the whole working set)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.config = ROOT / "configs" / "tiny.yaml"
        args.copy_blocks, args.repeats = 64, 2
        args.conversations, args.prompt_len, args.output_len, args.append_len = 12, 8, 4, 4
    base = load_config(args.config)
    block_size = base.cache.block_size
    turn_blocks = -(-(2 * args.prompt_len + 2 * args.output_len + args.append_len) // block_size)
    working_set = args.conversations * turn_blocks
    # room for one second turn at least, so the pool never stalls
    num_blocks = args.num_blocks or max(working_set // 3, turn_blocks + 2)
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "device": jax.devices()[0].device_kind, "working_set_blocks": working_set}

    block_bytes = kv_block_bytes(base)
    host_gib = args.host_kv_gib or working_set * block_bytes * 1.1 / GIB
    if not args.skip_copy:
        copy_gib = (args.copy_blocks + 1) * block_bytes / GIB
        copy_config = base.with_overrides(host_kv_gib=copy_gib, num_blocks=args.copy_blocks + 1, precompile=False)
        report["copy"] = copy_bandwidth(copy_config, args.copy_blocks, args.repeats)  # (moves compile on warm-up)
        gc.collect()
        copy = report["copy"]
        for direction in ("device_to_host", "host_to_device"):
            item = copy[direction]
            share = item.get("share_of_pinned_copy")
            print(f"{direction}: {item['gb_per_s']:.2f} GB/s, {item['blocks_per_s']:.0f} blocks/s "
                  f"({copy['num_blocks']} blocks of {copy['block_bytes'] / 1e6:.2f} MB, host blocks: "
                  f"{copy['host_blocks']})"
                  + ("" if share is None else f", {share:.0%} of a plain pinned copy"))
        print("plain copies, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in copy["plain_gb_per_s"].items()))
        print(f"round trip (random blocks saved, loaded elsewhere): "
              f"{'exact' if copy['round_trip_exact'] else 'MISMATCH'}")
    turns = {}
    for name, gib in (("host_tier_off", 0.0), ("host_tier_on", host_gib)):
        config = base.with_overrides(num_blocks=num_blocks, host_kv_gib=gib)
        turns[name] = result = multi_turn(config, args)
        ttft = result["turn2_ttft_ms"]
        print(f"{name}: turn-2 TTFT p50 {ttft['p50']:.1f} ms p90 {ttft['p90']:.1f} ms, "
              f"{result['total_tokens_per_s']:.0f} tokens/s, turn-2 prefix hit rate {result['turn2_hit_rate']:.1%} "
              f"(host {result['turn2_host_hits']} tokens), {result['num_preemptions']} preemptions "
              f"({num_blocks} device blocks, working set {working_set})")
        print(f"{name}: turn 1 took {result['turn1_s']:.2f} s, turn 2 {result['turn2_s']:.2f} s")
    on, off = turns["host_tier_on"], turns["host_tier_off"]
    report["turns"] = turns
    report["ratios"] = {"turn2_ttft_p50_on_over_off": on["turn2_ttft_ms"]["p50"] / off["turn2_ttft_ms"]["p50"],
                        "throughput_on_over_off": on["total_tokens_per_s"] / off["total_tokens_per_s"]}
    print("on / off: turn-2 TTFT p50 {turn2_ttft_p50_on_over_off:.2f}x, throughput {throughput_on_over_off:.2f}x"
          .format(**report["ratios"]))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
