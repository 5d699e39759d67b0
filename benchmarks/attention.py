"""Attention kernel benchmarks on one GPU: one function per section, a short table printed last.

    PYTHONPATH=. python benchmarks/attention.py --section decode|mixed|all [--sweep] [--json FILE]
        [--kv-dtype bfloat16|float8_e4m3fn]

decode: paged decode (one query token per request), 32 q / 8 kv heads, head dim 128, page 16,
bf16 (or --kv-dtype float8_e4m3fn, unit scales), pages randomly permuted. Effective TB/s = K+V bytes the requests own (sum of seq_lens x K x
H x 2 x 2 B) / time. Peers in the same run: JAX's Pallas `ops.gpu.paged_attention` (Triton) and
the pure-jnp reference compiled by XLA (a gather). Times are per call, from many calls inside
one jit (lax.fori_loop; each call's q depends on the previous output so nothing is hoisted),
median of several repeats; `loop` is the same loop around a trivial body (its overhead is
inside every figure).

mixed: one ragged batch of 48 decode rows (ctx 4096) + 2 chunked-prefill rows (512 new tokens over
a 4096-token cached context), same heads/page/dtype, through our entry point, against its two
parts run alone through the same entry point (the same cache and block-table rows). Ratio =
mixed / (decode alone + prefill alone), target <= 1.1. Decode TB/s = K+V bytes of the decode
rows / time; prefill TFLOP/s = 4 x (q.k pairs under the causal mask) x N x H / time. `--sweep`
also times general-kernel configs on the prefill part.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

DECODE_SHAPES = ((64, 2048), (64, 8192), (8, 32768))  # (requests B, context tokens per request)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def time_per_call(fn, q, *args, min_seconds=0.05, repeats=5):
    """Seconds per fn(q, *args) call: many calls inside one jit, median over `repeats`."""

    def make(iters):
        @jax.jit
        def loop(q, *args):
            def body(_, carry):
                q_i = q + carry.astype(q.dtype)  # a data dependence on the previous call
                out = fn(q_i, *args)
                return out.reshape(-1)[0].astype(jnp.float32) * 1e-30
            return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
        return loop

    probe = make(1)
    probe(q, *args).block_until_ready()
    start = time.perf_counter()
    probe(q, *args).block_until_ready()
    iters = int(min(2000, max(5, min_seconds / max(time.perf_counter() - start, 1e-6))))
    loop = make(iters)
    loop(q, *args).block_until_ready()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        loop(q, *args).block_until_ready()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def _row(section, shape, impl, seconds, value, unit, note) -> dict:
    """One result: `value` in `unit` (TB/s, TFLOP/s, ...); printed as a JSON line at once."""
    row = dict(section=section, shape=shape, impl=impl,
               us=None if seconds is None else seconds * 1e6, value=value, unit=unit, note=note)
    print(json.dumps(row), flush=True)
    return row


def _decode_inputs(batch, context, key, kv_dtype="bfloat16"):
    from pallas_kernels.paged_attention import layout

    pages_per_req = context // PAGE_SIZE
    num_pages = batch * pages_per_req + 1  # page 0: the null block
    kq, kk, kp = jax.random.split(key, 3)
    kv = jax.random.normal(kk, layout.kv_cache_shape(num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM),
                           jnp.bfloat16).astype(kv_dtype)
    q = jax.random.normal(kq, (batch, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    block_tables = (1 + jax.random.permutation(kp, num_pages - 1)).reshape(batch, pages_per_req)
    block_tables = block_tables.astype(jnp.int32)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    return q, kv, qsl, seq_lens, block_tables


def decode_section(args) -> list[dict]:
    from pallas_kernels.paged_attention import gpu, layout, reference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    sm_scale = HEAD_DIM ** -0.5
    rows = []
    for batch, context in DECODE_SHAPES:
        q, kv, qsl, seq_lens, block_tables = _decode_inputs(batch, context, jax.random.key(batch),
                                                            args.kv_dtype)
        kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * kv.dtype.itemsize
        shape = f"B={batch} ctx={context}"

        ours = lambda q, kv, qsl, lens, bt, config=None: gpu.ragged_paged_attention(
            q, kv, qsl, lens, bt, sm_scale=sm_scale, config=config)
        expected = jax.jit(ours)(q, kv, qsl, seq_lens, block_tables)

        def record(name, seconds, out=None):
            note = "" if out is None else "max|diff| vs ours {:.1e}".format(float(jnp.max(
                jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32)))))
            tbps = None if out is None else kv_bytes / seconds / 1e12
            rows.append(_row("decode", shape, name, seconds, tbps, "TB/s", note))

        configs = [("ours", None)]
        if args.sweep:
            configs += [(_label(c, args.kv_dtype), c) for c in _sweep_configs(batch, args.kv_dtype)]
        for name, config in configs:
            fn = lambda q, kv, qsl, lens, bt, config=config: ours(q, kv, qsl, lens, bt, config)
            try:
                out = jax.jit(fn)(q, kv, qsl, seq_lens, block_tables)
                record(name, time_per_call(fn, q, kv, qsl, seq_lens, block_tables), out)
            except Exception as e:  # a sweep point that fails to compile is reported, not fatal
                rows.append(_row("decode", shape, name, None, None, "", repr(e)[:300]))

        if args.kv_dtype != "bfloat16":  # the peers read bf16 caches only
            record("loop overhead", time_per_call(lambda q, *a: q, q, qsl))
            continue
        k_pages, v_pages = kv[0], kv[1]  # JAX's layout [K, P, S, H], split outside the timed loop
        q_scaled = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)  # JAX's kernel has no scale
        jax_fn = lambda q, k, v, bt, lens: jax_paged.paged_attention(q, k, v, bt, lens)
        out = jax.jit(jax_fn)(q_scaled, k_pages, v_pages, block_tables, seq_lens)
        record("jax pallas paged_attention", time_per_call(jax_fn, q_scaled, k_pages, v_pages,
                                                           block_tables, seq_lens), out)
        del k_pages, v_pages

        kv_ref = layout.to_reference_layout(kv)  # transposed outside the timed loop
        ref_fn = lambda q, kv, qsl, lens, bt: reference.ragged_paged_attention(
            q, kv, qsl, lens, bt, sm_scale=sm_scale)
        out = jax.jit(ref_fn)(q, kv_ref, qsl, seq_lens, block_tables)
        record("xla gather (reference)", time_per_call(ref_fn, q, kv_ref, qsl, seq_lens,
                                                       block_tables), out)
        del kv_ref
        record("loop overhead", time_per_call(lambda q, *a: q, q, qsl))
    return rows


def _sweep_configs(batch, kv_dtype="bfloat16"):
    from pallas_kernels.paged_attention import gpu

    base = dict(decode_block_kv=64, decode_num_warps=4, decode_num_stages=3)
    variants = [dict(decode_block_kv=128), dict(decode_block_kv=128, decode_num_warps=8),
                dict(decode_num_stages=4), dict(decode_block_kv=32, decode_num_stages=4),
                dict(decode_num_stages=2), dict(decode_num_warps=8)]
    if kv_dtype != "bfloat16":  # the fp8 cache's own tile knobs, around the default (bk=128 st=5 float16 dots)
        base = dict(decode_fp8_block_kv=128, decode_num_warps=4, decode_fp8_num_stages=5,
                    decode_fp8_dots="float16")
        variants = [dict(), dict(decode_fp8_dots="q"), dict(decode_fp8_dots="float8_e4m3fn"),
                    dict(decode_fp8_block_kv=64, decode_fp8_num_stages=3),
                    dict(decode_fp8_block_kv=256, decode_fp8_num_stages=3),
                    dict(decode_fp8_num_stages=4), dict(decode_fp8_num_stages=6), dict(decode_num_warps=8),
                    dict(decode_fp8_block_kv=64, decode_fp8_num_stages=6)]
    splits = (1, 2, 4, 8) if batch >= 64 else (4, 8, 16, 32)
    variants += [dict(decode_splits=s) for s in splits]
    return [gpu.TuningConfig(**{**base, **v}) for v in variants]


def _label(config, kv_dtype="bfloat16") -> str:
    splits = "auto" if config.decode_splits is None else config.decode_splits
    if kv_dtype == "bfloat16":
        return (f"sweep bk={config.decode_block_kv} w={config.decode_num_warps} "
                f"st={config.decode_num_stages} splits={splits}")
    return (f"sweep bk={config.decode_fp8_block_kv} w={config.decode_num_warps} "
            f"st={config.decode_fp8_num_stages} splits={splits} dots={config.decode_fp8_dots}")


MIXED_DECODE = (48, 4096)  # (decode rows, context per row)
MIXED_PREFILL = (2, 512, 4096)  # (chunked-prefill rows, new tokens per row, cached context)


def _mixed_inputs(key):
    """The mixed batch (decode rows first, then prefill rows) and its two parts, sharing one cache."""
    from pallas_kernels.paged_attention import layout

    num_dec, dec_ctx = MIXED_DECODE
    num_pre, chunk, pre_ctx = MIXED_PREFILL
    seq_lens = np.array([dec_ctx] * num_dec + [pre_ctx + chunk] * num_pre, np.int32)
    max_blocks = -(-int(seq_lens.max()) // PAGE_SIZE)
    pages = [-(-int(s) // PAGE_SIZE) for s in seq_lens]
    num_pages = sum(pages) + 1  # page 0: the null block
    kq, kk, kp = jax.random.split(key, 3)
    kv = jax.random.normal(kk, layout.kv_cache_shape(num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM),
                           jnp.bfloat16)
    order = 1 + np.asarray(jax.random.permutation(kp, num_pages - 1))
    block_tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    used = 0
    for r, n in enumerate(pages):
        block_tables[r, :n] = order[used:used + n]
        used += n
    q_lens = np.array([1] * num_dec + [chunk] * num_pre, np.int32)
    q = jax.random.normal(kq, (int(q_lens.sum()), NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)

    def batch(rows):
        qsl = np.concatenate([[0], np.cumsum(q_lens[rows])]).astype(np.int32)
        tokens = np.concatenate([np.arange(qsl_all[r], qsl_all[r] + q_lens[r]) for r in rows])
        return (q[tokens], kv, jnp.asarray(qsl), jnp.asarray(seq_lens[rows]),
                jnp.asarray(block_tables[rows]))

    qsl_all = np.concatenate([[0], np.cumsum(q_lens)])
    dec, pre = list(range(num_dec)), list(range(num_dec, num_dec + num_pre))
    return batch(dec + pre), batch(dec), batch(pre)


def _causal_pairs(q_len: int, seq_len: int) -> int:
    """(query, key) pairs under the causal mask for the last q_len rows of a seq_len sequence."""
    context = seq_len - q_len
    return q_len * context + q_len * (q_len + 1) // 2


def mixed_section(args) -> list[dict]:
    from pallas_kernels.paged_attention import gpu

    sm_scale = HEAD_DIM ** -0.5
    mixed, dec, pre = _mixed_inputs(jax.random.key(4))
    num_dec, dec_ctx = MIXED_DECODE
    num_pre, chunk, pre_ctx = MIXED_PREFILL
    kv_bytes_per_token = NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    dec_bytes = num_dec * dec_ctx * kv_bytes_per_token
    pre_bytes = num_pre * (pre_ctx + chunk) * kv_bytes_per_token
    pre_flops = 4 * num_pre * _causal_pairs(chunk, pre_ctx + chunk) * NUM_Q_HEADS * HEAD_DIM
    dec_flops = 4 * num_dec * dec_ctx * NUM_Q_HEADS * HEAD_DIM
    shape = f"{num_dec}x{dec_ctx}+{num_pre}x{chunk}/{pre_ctx}"

    def ours(q, kv, qsl, lens, bt, config=None):
        return gpu.ragged_paged_attention(q, kv, qsl, lens, bt, sm_scale=sm_scale, config=config)

    out_mixed = jax.jit(ours)(*mixed)
    parts = jnp.concatenate([jax.jit(ours)(*dec), jax.jit(ours)(*pre)])
    diff = float(jnp.max(jnp.abs(out_mixed.astype(jnp.float32) - parts.astype(jnp.float32))))

    rows, seconds = [], {}
    for name, batch, nbytes, flops in (("mixed", mixed, dec_bytes + pre_bytes, dec_flops + pre_flops),
                                       ("decode rows alone", dec, dec_bytes, dec_flops),
                                       ("prefill rows alone", pre, pre_bytes, pre_flops)):
        t = seconds[name] = time_per_call(ours, *batch)
        note = f"{nbytes / t / 1e12:.2f} TB/s K+V, {flops / t / 1e12:.1f} TFLOP/s"
        if name == "mixed":
            note += f"; max|mixed - parts| {diff:.1e}"
        value, unit = (flops / t / 1e12, "TFLOP/s") if name.startswith("prefill") else (
            nbytes / t / 1e12, "TB/s")
        rows.append(_row("mixed", shape, name, t, value, unit, note))
    ratio = seconds["mixed"] / (seconds["decode rows alone"] + seconds["prefill rows alone"])
    floor = dec_bytes / 4.3e12 + pre_flops / 790e12  # measured copy / GEMM ceilings
    rows.append(_row("mixed", shape, "ratio mixed/(dec+pre)", None, ratio, "x",
                     f"target <= 1.1; mixed / roofline floor {seconds['mixed'] / floor:.2f}x "
                     f"(floor {floor * 1e6:.0f} us)"))
    rows.append(_row("mixed", shape, "loop overhead", time_per_call(lambda q, *a: q, mixed[0],
                                                                    mixed[2]), None, "", ""))
    if args.sweep:
        for cfg in _general_sweep_configs():
            try:
                t = time_per_call(lambda *a, cfg=cfg: ours(*a, config=cfg), *pre)
                rows.append(_row("mixed", shape, _general_label(cfg), t, pre_flops / t / 1e12,
                                 "TFLOP/s", "prefill rows alone"))
            except Exception as e:  # a sweep point that fails to compile is reported, not fatal
                rows.append(_row("mixed", shape, _general_label(cfg), None, None, "",
                                 repr(e)[:300]))
    return rows


def _general_sweep_configs():
    from pallas_kernels.paged_attention import gpu

    variants = [dict(general_rows=128), dict(general_rows=128, general_num_warps=8),
                dict(general_block_kv=128), dict(general_rows=128, general_block_kv=128,
                                                 general_num_warps=8),
                dict(general_num_stages=3), dict(general_rows=256, general_num_warps=8)]
    return [gpu.TuningConfig(**v) for v in variants]


def _general_label(config) -> str:
    return (f"sweep rows={config.general_rows} bk={config.general_block_kv} "
            f"w={config.general_num_warps} st={config.general_num_stages}")


SECTIONS = {"decode": decode_section, "mixed": mixed_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    parser.add_argument("--sweep", action="store_true", help="also time tuning-config variants")
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float8_e4m3fn"], default="bfloat16",
                        help="the decode section's cache dtype (an fp8 cache: ours only, no peers)")
    args = parser.parse_args()

    device = jax.devices()[0]
    header = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"{device.device_kind}, jax {jax.__version__}")
    print(header, flush=True)
    rows = []
    for name in SECTIONS if args.section == "all" else [args.section]:
        rows += SECTIONS[name](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, rows=rows), f, indent=1)

    print(f"\n{header}")
    print(f"{'section':8} {'shape':16} {'impl':28} {'us':>8} {'value':>13}  note")
    for row in rows:
        if row["section"] == "decode" and row["impl"].startswith("sweep"):
            continue  # decode sweep points are in the JSON lines above
        us = "" if row["us"] is None else f"{row['us']:8.1f}"
        value = "" if row["value"] is None else f"{row['value']:.2f} {row['unit']}"
        print(f"{row['section']:8} {row['shape']:16} {row['impl']:28} {us:>8} {value:>13}  "
              f"{row['note']}")


if __name__ == "__main__":
    main()
