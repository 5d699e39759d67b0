"""Tight-loop decode peer of the engine's decode benchmarks: a plain jitted JAX decode step, no engine,
for the same model shape.

    config.json -> random weights made on the device (one jitted jax.random per shape; no host copy)
    caches: per layer one K and one V array, contiguous, [B, L, K, H] (or [B, K, L, H] with
            --cache-layout bklh), filled with random values (only the memory traffic matters)
    decode_step(params, caches (donated), tokens [B], positions [B]) -> (tokens [B], caches, positions + 1)
        x = embed[tokens]; for each layer (unrolled in Python, not lax.scan):
            RMSNorm -> q, k, v -> rope at `positions` -> k, v written at `positions`
            -> attention of q over the whole cache, masked to [0, position] -> wo, residual
            -> RMSNorm -> SwiGLU MLP, residual
        -> RMSNorm -> lm_head (float32 logits) -> argmax (greedy)
    --steps steps are dispatched back to back (sampled tokens stay on the device), from position
    `context`; tokens/s = B * steps / time (median of 3 runs, after a warm-up that also compiles)
    --executables 1: the step is one jitted executable, as plainly written. 2: two executables of the same
    step, compiled from one lowering, that the steps alternate between, with XLA's sibling-dot merging
    allowed for the 8B shape's weights (the GPU options of jaxserve/runner/step_program.py). XLA:GPU runs a
    step as a CUDA graph and re-records the nodes whose buffers moved since its last call; a step
    dispatched while the one before still holds its temporaries gets other addresses, so one executable
    re-records nearly its whole graph every step and two keep theirs. Both are measured by default, and
    the faster is the peer the engine's benchmarks compare against.

Roofline (the formula of jaxserve/bench/common.py):
    bytes per step = W + B * C * num_layers * 2 * K * H * dtype bytes,  roofline tokens/s = B * 4.3e12 / bytes
W: bytes of all weights; C: mean context of the timed steps, context + steps / 2. The loop's attention
reads the whole cache (L = context + steps, masked), so it moves a little more than C tokens per row.

    PYTHONPATH=. python3 benchmarks/tight_loop_decode.py --config-json configs/models/llama3-8b/config.json
    python benchmarks/tight_loop_decode.py --config-json tests/fixtures/hf/llama3_gqa4_tied/config.json \\
        --batch-sizes 1,2 --context 8 --steps 4          (CPU smoke check)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.runner.step_program import GPU_COMPILER_OPTIONS, TWIN_COMPILER_OPTIONS

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy bandwidth, measured
REPEATS = 3
WARMUP_STEPS = 8
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
LAYOUTS = ("blkh", "bklh")


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    width: int  # D
    ffw: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    tied: bool
    dtype: str

    @classmethod
    def from_hf(cls, path: Path, dtype: str) -> Shape:
        hf = json.loads(path.read_text())
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if dtype == "auto":
            dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
        return cls(hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], heads,
                   hf.get("num_key_value_heads") or heads, hf.get("head_dim") or hf["hidden_size"] // heads,
                   float(hf.get("rms_norm_eps", 1e-6)), float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
                   bool(hf.get("tie_word_embeddings", False)), dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _random(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def make_params(s: Shape, key) -> dict:
    """Weights in x @ W orientation, made on the device; norms are ones."""
    dtype = DTYPES[s.dtype]
    keys = iter(jax.random.split(key, 7 * s.num_layers + 2))

    def w(*shape):
        return _random(next(keys), shape, dtype, 0.02)

    nh, kh = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layers = [{"attn_norm": jnp.ones(s.width, dtype), "wq": w(s.width, nh), "wk": w(s.width, kh),
               "wv": w(s.width, kh), "wo": w(nh, s.width), "mlp_norm": jnp.ones(s.width, dtype),
               "w_gate": w(s.width, s.ffw), "w_up": w(s.width, s.ffw), "w_down": w(s.ffw, s.width)}
              for _ in range(s.num_layers)]
    params = {"embed": w(s.vocab, s.width), "layers": layers, "final_norm": jnp.ones(s.width, dtype)}
    if not s.tied:
        params["lm_head"] = w(s.width, s.vocab)
    return params


def make_caches(s: Shape, batch: int, max_len: int, layout: str, key) -> list[tuple[jax.Array, jax.Array]]:
    shape = ((batch, max_len, s.num_kv_heads, s.head_dim) if layout == "blkh"
             else (batch, s.num_kv_heads, max_len, s.head_dim))
    keys = jax.random.split(key, 2 * s.num_layers)
    return [(_random(keys[2 * i], shape, DTYPES[s.dtype], 1.0), _random(keys[2 * i + 1], shape, DTYPES[s.dtype], 1.0))
            for i in range(s.num_layers)]


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    return weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def rope(x, positions, theta):
    """x [B, heads, H] rotated (HF rotate_half convention) by `positions` [B]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq  # [B, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("s", "layout"), donate_argnames=("caches",))
def decode_step(params, caches, tokens, positions, s: Shape, layout: str):
    batch, group = tokens.shape[0], s.num_heads // s.num_kv_heads
    rows = jnp.arange(batch)
    x = params["embed"][tokens]  # [B, D]
    new_caches = []
    for lp, (k_cache, v_cache) in zip(params["layers"], caches):
        h = rms_norm(x, lp["attn_norm"], s.rms_norm_eps)
        q = rope((h @ lp["wq"]).reshape(batch, s.num_heads, s.head_dim), positions, s.rope_theta)
        k = rope((h @ lp["wk"]).reshape(batch, s.num_kv_heads, s.head_dim), positions, s.rope_theta)
        v = (h @ lp["wv"]).reshape(batch, s.num_kv_heads, s.head_dim)
        q = q.reshape(batch, s.num_kv_heads, group, s.head_dim)
        if layout == "blkh":
            k_cache, v_cache = k_cache.at[rows, positions].set(k), v_cache.at[rows, positions].set(v)
            scores = jnp.einsum("bkgh,blkh->bkgl", q, k_cache, preferred_element_type=jnp.float32)
        else:
            heads = jnp.arange(s.num_kv_heads)[None, :]
            k_cache = k_cache.at[rows[:, None], heads, positions[:, None]].set(k)
            v_cache = v_cache.at[rows[:, None], heads, positions[:, None]].set(v)
            scores = jnp.einsum("bkgh,bklh->bkgl", q, k_cache, preferred_element_type=jnp.float32)
        new_caches.append((k_cache, v_cache))
        valid = jnp.arange(scores.shape[-1])[None, :] <= positions[:, None]  # [B, L]
        scores = jnp.where(valid[:, None, None, :], scores * s.head_dim ** -0.5, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
        spec = "bkgl,blkh->bkgh" if layout == "blkh" else "bkgl,bklh->bkgh"
        attn = jnp.einsum(spec, probs, v_cache).reshape(batch, s.num_heads * s.head_dim)
        x = x + attn @ lp["wo"]
        h = rms_norm(x, lp["mlp_norm"], s.rms_norm_eps)
        x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    x = rms_norm(x, params["final_norm"], s.rms_norm_eps)
    head = params["embed"].T if s.tied else params["lm_head"]
    logits = jnp.einsum("bd,dv->bv", x, head, preferred_element_type=jnp.float32)
    return jnp.argmax(logits, -1).astype(jnp.int32), new_caches, positions + 1


# XLA:GPU options of the two executables (--executables 2): the engine's step and its twin's.
TWIN_OPTIONS = (GPU_COMPILER_OPTIONS, TWIN_COMPILER_OPTIONS)


def step_programs(params, caches, tokens, positions, s: Shape, layout: str, executables: int) -> list:
    """The decode steps the loop cycles through: decode_step itself, or two executables of one lowering
    (XLA:GPU options only on a GPU)."""
    if executables == 1:
        return [functools.partial(decode_step, s=s, layout=layout)]
    lowered = decode_step.lower(params, caches, tokens, positions, s=s, layout=layout)
    on_gpu = jax.devices()[0].platform == "gpu"
    return [lowered.compile(options if on_gpu else None) for options in TWIN_OPTIONS]


def measure(s: Shape, params, batch: int, context: int, steps: int, layout: str, executables: int = 1) -> dict:
    """Seconds per decode step at `batch` rows from position `context` (median of REPEATS runs), the
    steps cycling through `executables` executables (step_programs)."""
    caches = make_caches(s, batch, context + max(steps, WARMUP_STEPS), layout, jax.random.key(1))
    first_tokens = jax.random.randint(jax.random.key(2), (batch,), 0, s.vocab, jnp.int32)
    first_positions = jnp.full((batch,), context, jnp.int32)
    programs = step_programs(params, caches, first_tokens, first_positions, s, layout, executables)
    tokens, positions = first_tokens, first_positions
    for i in range(WARMUP_STEPS):
        tokens, caches, positions = programs[i % len(programs)](params, caches, tokens, positions)
    tokens.block_until_ready()
    times = []
    for _ in range(REPEATS):
        tokens, positions = first_tokens, first_positions
        start = time.perf_counter()
        for i in range(steps):
            tokens, caches, positions = programs[i % len(programs)](params, caches, tokens, positions)
        tokens.block_until_ready()
        times.append(time.perf_counter() - start)
    del caches
    step_s = statistics.median(times) / steps
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    kv_bytes_per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim * jnp.dtype(DTYPES[s.dtype]).itemsize
    step_bytes = weight_bytes + batch * (context + steps / 2) * kv_bytes_per_token
    roofline = batch * HBM_BYTES_PER_S / step_bytes
    return {"layout": layout, "executables": executables, "batch": batch, "context": context, "steps": steps,
            "ms_per_step": step_s * 1e3,
            "tokens_per_s": batch / step_s, "bytes_per_step": step_bytes, "roofline_tokens_per_s": roofline,
            "roofline_share": batch / step_s / roofline}


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config-json", type=Path, required=True, help="a Hugging Face config.json")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 64])
    parser.add_argument("--context", type=int_list, default=[128, 2048],
                        help="tokens already in the cache: one value per batch size, or one for all")
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps per run")
    parser.add_argument("--dtype", default="auto", help="auto (the config's torch_dtype) | bfloat16 | float16 | float32")
    parser.add_argument("--cache-layout", default="blkh",
                        help="comma-separated cache layouts to measure: blkh ([B, L, K, H]) and/or bklh")
    parser.add_argument("--executables", type=int_list, default=[1, 2],
                        help="comma-separated: 1 (one jitted step) and/or 2 (two alternating executables)")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args(argv)
    contexts = args.context * len(args.batch_sizes) if len(args.context) == 1 else args.context
    if len(contexts) != len(args.batch_sizes):
        parser.error(f"--context has {len(args.context)} values for {len(args.batch_sizes)} batch sizes; "
                     "give one per batch size or one for all")
    layouts = args.cache_layout.split(",")
    if any(layout not in LAYOUTS for layout in layouts) or args.steps < 1:
        parser.error(f"--cache-layout must list {' or '.join(LAYOUTS)} and --steps must be >= 1")
    if any(n not in (1, 2) for n in args.executables):
        parser.error(f"--executables takes 1 and/or 2, got {args.executables}")

    s = Shape.from_hf(args.config_json, args.dtype)
    params = make_params(s, jax.random.key(0))
    print(f"{args.config_json}: {s.num_layers} layers, D={s.width}, N/K={s.num_heads}/{s.num_kv_heads}, "
          f"H={s.head_dim}, F={s.ffw}, V={s.vocab}, {s.dtype}; {jax.devices()[0].device_kind}")
    print(f"{'layout':>6} {'exe':>3} {'batch':>5} {'context':>7} {'ms/step':>9} {'tokens/s':>10} {'GB/step':>8} "
          f"{'roofline tok/s':>14} {'share':>6}")
    rows = []
    for layout, executables in itertools.product(layouts, args.executables):
        for batch, context in zip(args.batch_sizes, contexts):
            row = measure(s, params, batch, context, args.steps, layout, executables)
            rows.append(row)
            print(f"{layout:>6} {executables:3d} {batch:5d} {context:7d} {row['ms_per_step']:9.3f} "
                  f"{row['tokens_per_s']:10.1f} "
                  f"{row['bytes_per_step'] / 1e9:8.2f} {row['roofline_tokens_per_s']:14.1f} "
                  f"{row['roofline_share']:6.1%}")
    if args.output_json:
        args.output_json.write_text(json.dumps({"config": str(args.config_json), "dtype": s.dtype,
                                                "device": jax.devices()[0].device_kind, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
