"""Causal GQA prefill attention on one GPU: our Pallas Triton and Mosaic GPU kernels against cuDNN and XLA.

B=1, 32 q heads / 8 kv heads, head dim 128, bf16, S in (4096, 16384). Causal FLOPs are counted as
2·B·S²·N·H (half of the 4·B·S²·N·H of full attention). Each time is the median over repeats of one
jitted `fori_loop` running the attention `iters` times back to back (an optimization barrier
threads q through the loop so XLA cannot hoist the call), divided by `iters`; a CUPTI kernel-time
column (sum of the kernels of one call, median of 5) cross-checks it where CUPTI is available.
Accuracy is the relative L2 error against the float32 reference at S=4096 and against cuDNN above.

    PYTHONPATH=. python3 benchmarks/prefill_attention.py [--seq-lens 4096 16384] [--no-sweep]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.flash_attention import FlashAttentionConfig, default_config, flash_attention
from pallas_kernels.flash_attention import flash_attention_reference, mosaic_gpu

warnings.simplefilter("ignore", DeprecationWarning)  # every Triton lowering warns in JAX 0.11

SWEEP = (
    FlashAttentionConfig(block_q=128, block_k=64, num_warps=8, num_stages=3),
    FlashAttentionConfig(block_q=128, block_k=64, num_warps=8, num_stages=4),
    FlashAttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=2),
    FlashAttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=3),
    FlashAttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=3),
    FlashAttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=3),
)

MOSAIC = (
    mosaic_gpu.MosaicAttentionConfig(block_q=64, block_kv=128, num_stages=2),
    mosaic_gpu.MosaicAttentionConfig(block_q=64, block_kv=128, num_stages=3),
    mosaic_gpu.MosaicAttentionConfig(block_q=64, block_kv=128, num_stages=2, pingpong=True),
    mosaic_gpu.MosaicAttentionConfig(block_q=64, block_kv=128, num_stages=3, pingpong=True),
)


def _loop_ms(fn, q, k, v, iters: int, repeats: int = 5) -> float:
    @jax.jit
    def run(q, k, v):
        def body(_, carry):
            q, _ = carry
            return lax.optimization_barrier((q, fn(q, k, v)))

        return lax.fori_loop(0, iters, body, (q, jnp.zeros_like(q)))[1]

    run(q, k, v).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(q, k, v).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / iters * 1e3


def _cupti_ms(fn, q, k, v) -> float | None:
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per_iter = profiler.measure(fn, iterations=5)(q, k, v)
        return statistics.median(per_iter)
    except Exception:  # CUPTI is optional: the loop time is the figure
        return None


def _rel_err(out, ref) -> float:
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@jax.jit
def _mgpu(q, k, v):
    """JAX's own Mosaic GPU FA3-style kernel (fp16 SMEM): a reference point, not ours."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return attention_mgpu.attention(q, k, v, config)


def bench_prefill(seq_lens=(4096, 16384), sweep: bool = True, num_q_heads: int = 32, num_kv_heads: int = 8,
                  head_dim: int = 128, dtype=jnp.bfloat16) -> list[dict]:
    device = jax.devices()[0]
    print(f"# {datetime.date.today()}  {device.device_kind}  jax {jax.__version__}  backend {jax.default_backend()}")
    print(f"# causal, B=1, N={num_q_heads}, K={num_kv_heads}, H={head_dim}, {jnp.dtype(dtype).name}")
    default = default_config(head_dim, dtype)
    configs = [default] + ([c for c in SWEEP if c != default] if sweep else [])
    rows = []
    for seq_len in seq_lens:
        rng = np.random.default_rng(seq_len)
        q, k, v = (jnp.asarray(rng.standard_normal((1, seq_len, heads, head_dim), np.float32), dtype)
                   for heads in (num_q_heads, num_kv_heads, num_kv_heads))
        flops = 2 * seq_len**2 * num_q_heads * head_dim
        iters = int(np.clip(round(0.06 / (flops / 400e12)), 2, 100))
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
        if seq_len <= 4096:
            ref_name = "f32 reference"
            ref = jax.jit(flash_attention_reference)(*(x.astype(jnp.float32) for x in (q, k, v)))
        else:
            ref_name, ref = "cuDNN", cudnn(q, k, v)

        impls = [(f"ours triton {c.block_q}x{c.block_k} w{c.num_warps} s{c.num_stages}"
                  + (" (default)" if c == default else ""),
                  jax.jit(lambda q, k, v, c=c: flash_attention(q, k, v, config=c)), (q, k, v)) for c in configs]
        mosaic_default = mosaic_gpu.MosaicAttentionConfig()
        impls += [(f"ours mosaic {c.block_q}x{c.block_kv} s{c.num_stages}"
                   + (" pingpong" if c.pingpong else "") + (" (default)" if c == mosaic_default else ""),
                   jax.jit(lambda q, k, v, c=c: mosaic_gpu.flash_attention(q, k, v, config=c)),
                   (q, k, v)) for c in MOSAIC]
        half = tuple(x.astype(jnp.float16) for x in (q, k, v))
        impls += [("cuDNN", cudnn, (q, k, v)), ("jax attention_mgpu (fp16)", _mgpu, half), ("XLA", xla, (q, k, v))]
        for name, fn, args in impls:
            row = dict(seq_len=seq_len, impl=name, ms=None, tflops=None, cupti_ms=None, err=None, note="")
            try:
                row["err"] = _rel_err(fn(*args), ref)
                row["ms"] = _loop_ms(fn, *args, iters=iters if name != "XLA" else max(2, iters // 8))
                row["tflops"] = flops / row["ms"] / 1e9
                row["cupti_ms"] = _cupti_ms(fn, *args)
            except Exception as e:  # an OOM or unsupported baseline is a row, not a crash
                row["note"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
                print(f"# {name} failed:\n{str(e)[:3000]}", flush=True)
            if row["err"] is not None and not row["err"] < 0.05:
                row["note"] = "WRONG OUTPUT: its time is not comparable"
            rows.append(row)
            print(_fmt(row, ref_name), flush=True)
        del q, k, v, ref, half

    print("\n| S | impl | ms | TFLOP/s | x cuDNN | CUPTI ms | rel err |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        base = next((r["tflops"] for r in rows if r["seq_len"] == seq_len and r["impl"] == "cuDNN"), None)
        for r in (r for r in rows if r["seq_len"] == seq_len):
            ratio = f"{r['tflops'] / base:.2f}" if r["tflops"] and base else "-"
            print(f"| {seq_len} | {r['impl']} | {_num(r['ms'], 3)} | {_num(r['tflops'], 0)} | {ratio} | "
                  f"{_num(r['cupti_ms'], 3)} | {_num(r['err'], 1, 'e')} |" + (f" {r['note']}" if r["note"] else ""))
    return rows


def _num(x, digits, kind="f"):
    return "-" if x is None else f"{x:.{digits}{kind}}"


def _fmt(row, ref_name):
    return (f"S={row['seq_len']:>6} {row['impl']:<38} {_num(row['ms'], 3):>8} ms {_num(row['tflops'], 0):>5} TFLOP/s"
            f"  cupti {_num(row['cupti_ms'], 3):>8} ms  err vs {ref_name} {_num(row['err'], 1, 'e')} {row['note']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--no-sweep", action="store_true", help="time only the default config of ours")
    args = parser.parse_args()
    bench_prefill(tuple(args.seq_lens), sweep=not args.no_sweep)
