"""The Python side of benchmarks/devrun_pd.sh: prefill/decode disaggregation's two figures.

    transfer --role recv --config C --port P        a decode-side receiver: the engine's KV caches and a PD
                                                    control server that takes each "ready" (pulls the chunks
                                                    it names, or unpacks its payload) and scatters it into
                                                    blocks 1..n (waits for the scatter), then answers "ack";
                                                    runs until killed
    transfer --role send --config C --peer H:P      the prefill side: per repetition, gather n blocks (the
             --tokens T --method M --json OUT       request's, n = T / block_size) from the live caches; with
                                                    --method device offer them as chunks to be pulled, with
                                                    host pack them to bytes and send them; wait for the ack;
                                                    reports GB/s of the KV bytes end to end and per phase,
                                                    beside a plain device copy of the same bytes in the same
                                                    process (its ceiling)
    mixed --url U --json OUT ...                    a load against one OpenAI endpoint (a colocated server or
                                                    the PD router): STREAMS steady decode streams (short
                                                    prompts, OUT_TOKENS each, restarted as they end) plus a
                                                    long prompt every 1/RATE s; reports the steady streams'
                                                    inter-token latency p50/p99, TTFT of both kinds and the
                                                    generated tokens per second
    peer --mib N --reps R --json OUT                two GPUs in one process: a plain copy of N MiB from the
                                                    first to the second (jax.device_put), the ceiling of the
                                                    transfer between instances on two GPUs

Prompts are token ids (random, seed 0), so any tokenizer serves. GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time


def _engine(config_path: str | None):
    from jaxserve.config import load_config
    from jaxserve.engine import Engine
    return Engine(load_config(config_path, precompile=False), progress=False)


def transfer_recv(args) -> int:
    from jaxserve.pd import protocol as proto
    from jaxserve.pd.device_transfer import DeviceEndpoint
    from jaxserve.pd.transfer import BlockMover, unpack
    engine = _engine(args.config)
    mover = BlockMover(engine.runner)
    key = proto.derive_key(args.token)
    endpoint = DeviceEndpoint(mover.first_device, "127.0.0.1")

    def handle(header: dict, payload: bytes) -> tuple[str, dict]:
        count, pull = int(header["num_blocks"]), header.get("pull")
        if pull is None:
            data = unpack(payload, count, header.get("layout"), mover.layout)
        else:
            data = endpoint.pull(pull["address"], pull["uuid"], pull["chunks"], mover.block_shape, mover.dtype,
                                 time.monotonic() + 120)
        for ids, chunk in mover.pieces(list(range(1, count + 1)), data):
            mover.scatter_piece(ids, chunk)
        engine.runner.kv_caches[0].block_until_ready()
        return "ack", {}

    server = proto.ControlServer(f"127.0.0.1:{args.port}", key, handle, timeout_s=120.0,
                                 max_payload_bytes=engine.runner.num_blocks * mover.block_bytes).start()
    print(f"receiver ready at {server.address}", flush=True)
    threading.Event().wait()
    return 0


def _emit(report: dict, path: str | None) -> None:
    """A subcommand's report to stdout, and to `path` (--json) when given."""
    print(json.dumps(report, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def _timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def transfer_send(args) -> int:
    import jax
    import jax.numpy as jnp

    from jaxserve.pd import protocol as proto
    from jaxserve.pd.device_transfer import DeviceEndpoint
    from jaxserve.pd.transfer import chunk_sizes
    from jaxserve.pd.transfer import BlockMover, pack
    engine = _engine(args.config)
    mover = BlockMover(engine.runner)
    key = proto.derive_key(args.token)
    count = args.tokens // engine.config.cache.block_size
    if count + 1 > engine.runner.num_blocks:
        print(f"error: {count} blocks do not fit the pool of {engine.runner.num_blocks}", file=sys.stderr)
        return 2
    ids = list(range(1, count + 1))
    nbytes = count * mover.block_bytes
    phases: dict[str, list[float]] = {"gather": [], "pack_d2h": [], "send_install": [], "end_to_end": []}
    endpoint = DeviceEndpoint(mover.first_device, "127.0.0.1") if args.method == "device" else None

    def once():
        t0 = time.perf_counter()
        if endpoint is not None:  # "pack_d2h" is then registering the chunks (no copy)
            chunks = mover.gather_chunks(ids, chunk_sizes(count))
            jax.block_until_ready(chunks)
            t1 = time.perf_counter()
            pull = {"address": endpoint.address, "uuid": endpoint.offer(chunks), "chunks": chunk_sizes(count)}
            t2 = time.perf_counter()
            message = proto.encode(key, "ready", proto.new_transfer_id(), num_blocks=count, layout=mover.layout,
                                   pull=pull)
        else:
            gathered = mover.gather_chunks(ids, chunk_sizes(count))
            jax.block_until_ready(gathered)
            t1 = time.perf_counter()
            payload = pack(gathered)
            t2 = time.perf_counter()
            message = proto.encode(key, "ready", proto.new_transfer_id(), payload, num_blocks=count,
                                   layout=mover.layout)
        reply = proto.request(args.peer, key, message, 120.0)
        t3 = time.perf_counter()
        assert reply["type"] == "ack", reply
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[name].append(seconds)

    for _ in range(args.warmup):
        once()
    for values in phases.values():
        values.clear()
    for _ in range(args.reps):
        once()
    block = jnp.concatenate(mover.gather_chunks(ids, chunk_sizes(count)))
    copy = jax.jit(lambda x: x + jnp.zeros((), x.dtype))
    copy(block).block_until_ready()
    copies = _timed(lambda: copy(block).block_until_ready(), args.reps)
    report = {"method": args.method, "tokens": args.tokens, "blocks": count, "bytes": nbytes, "block_bytes": mover.block_bytes,
              "layout": mover.layout, "device": str(jax.devices()[0].device_kind),
              "seconds": {name: statistics.median(values) for name, values in phases.items()},
              "device_copy_seconds": statistics.median(copies)}
    report["gbps"] = {name: nbytes / seconds / 1e9 for name, seconds in report["seconds"].items()}
    report["gbps"]["device_copy"] = nbytes / report["device_copy_seconds"] / 1e9
    _emit(report, args.json)
    return 0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def _stream(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, inter-chunk gaps, tokens) of one streamed completion."""
    import httpx
    start, times, tokens = time.perf_counter(), [], 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise httpx.HTTPStatusError(f"{response.status_code}: {await response.aread()!r}",
                                        request=response.request, response=response)
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
                    tokens += 1
    gaps = [b - a for a, b in zip(times, times[1:])]
    return (times[0] - start if times else float("nan")), gaps, tokens


async def _mixed(args) -> dict:
    import httpx
    rng = random.Random(0)
    low = 100 if args.vocab > 1000 else 3  # past the special tokens
    prompt = lambda n: [rng.randrange(low, args.vocab) for _ in range(n)]  # noqa: E731
    stop_at = time.perf_counter() + args.duration
    itl, short_ttft, long_ttft, tokens, errors = [], [], [], [0], []

    async def steady(client):
        while time.perf_counter() < stop_at:
            try:
                ttft, gaps, count = await _stream(client, args.url, prompt(args.short_len), args.out_tokens)
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors.append(repr(err))
                continue
            short_ttft.append(ttft)
            itl.extend(gaps)
            tokens[0] += count

    async def long_one(client):
        try:
            ttft, _, count = await _stream(client, args.url, prompt(args.long_len), 1)
        except Exception as err:  # noqa: BLE001
            errors.append(repr(err))
            return
        long_ttft.append(ttft)
        tokens[0] += count

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024)) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(steady(client)) for _ in range(args.streams)]
        longs = []
        await asyncio.sleep(args.warmup_s)
        while time.perf_counter() < stop_at:
            longs.append(asyncio.create_task(long_one(client)))
            await asyncio.sleep(1.0 / args.rate)
        await asyncio.gather(*tasks, *longs)
        elapsed = time.perf_counter() - start
    return {"url": args.url, "label": args.label, "streams": args.streams, "long_len": args.long_len,
            "rate": args.rate, "duration_s": elapsed, "errors": len(errors), "first_errors": errors[:3],
            "itl_p50_ms": 1e3 * (_percentile(itl, 50) or 0), "itl_p99_ms": 1e3 * (_percentile(itl, 99) or 0),
            "ttft_short_p50_ms": 1e3 * (_percentile(short_ttft, 50) or 0),
            "ttft_long_p50_ms": 1e3 * (_percentile(long_ttft, 50) or 0),
            "ttft_long_p99_ms": 1e3 * (_percentile(long_ttft, 99) or 0),
            "long_requests": len(long_ttft), "output_tokens_per_s": tokens[0] / elapsed}


def peer(args) -> int:
    import jax
    import jax.numpy as jnp

    devices = jax.devices()
    if len(devices) < 2:
        print(f"error: peer needs two devices in this process, it sees {len(devices)}", file=sys.stderr)
        return 2
    nbytes = args.mib * 2**20
    source = jax.device_put(jnp.zeros(nbytes // 2, jnp.bfloat16), devices[0]).block_until_ready()
    jax.device_put(source, devices[1]).block_until_ready()  # (warm-up)
    seconds = statistics.median(_timed(lambda: jax.device_put(source, devices[1]).block_until_ready(), args.reps))
    report = {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
              "devices": [str(d) for d in devices[:2]], "device": devices[0].device_kind}
    _emit(report, args.json)
    return 0


def mixed(args) -> int:
    report = asyncio.run(_mixed(args))
    _emit(report, args.json)
    return 1 if report["errors"] else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("transfer")
    t.add_argument("--role", choices=["send", "recv"], required=True)
    t.add_argument("--config")
    t.add_argument("--port", type=int, default=0)
    t.add_argument("--peer")
    t.add_argument("--token", default=None)
    t.add_argument("--tokens", type=int, default=8192)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--reps", type=int, default=5)
    t.add_argument("--json")
    t.add_argument("--method", choices=["device", "host"], default="device")
    m = sub.add_parser("mixed")
    m.add_argument("--url", required=True)
    m.add_argument("--label", default="")
    m.add_argument("--streams", type=int, default=32)
    m.add_argument("--short-len", type=int, default=64)
    m.add_argument("--out-tokens", type=int, default=256)
    m.add_argument("--long-len", type=int, default=3072)
    m.add_argument("--rate", type=float, default=0.5, help="long prompts per second")
    m.add_argument("--duration", type=float, default=60.0)
    m.add_argument("--warmup-s", type=float, default=2.0)
    m.add_argument("--vocab", type=int, default=32000)
    m.add_argument("--json")
    p = sub.add_parser("peer")
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "mixed":
        return mixed(args)
    if args.command == "peer":
        return peer(args)
    return transfer_send(args) if args.role == "send" else transfer_recv(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
