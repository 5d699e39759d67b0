"""FP8 KV cache: float8_e4m3fn pages with one static scale per (layer, K or V, kv head).

A stored value q means q * scale: the step's KV write divides by the scale, clips to the format's
finite range (+-448: float8_e4m3fn has no infinity, so an overflow would become NaN) and rounds; every
reader multiplies back, in registers, after its dot products.

Why static per-(layer, kv head) scales (vLLM's k_scale / v_scale; read from a checkpoint's
`k_scale` / `v_scale` / `kv_scale` tensors, else 1.0), not scales computed per block at write time:
- chunked writes: a block filled over several steps (chunked prefill, then decode) keeps the meaning
  of the tokens already in it. A per-block scale fixed by the first write would clip later, larger
  tokens; one raised by a later write would have to requantize (re-round) the earlier tokens.
- reads: a kernel program owns one kv head, so its scales are two scalars: K's folds into the softmax
  scale, V's into the output; no per-tile scale loads, no per-element multiply.
- blocks are self-contained bytes: prefix-cache sharing, preemption by swap, the host/disk KV tiers
  and prefill/decode transfers move raw fp8 blocks; the scales are model parameters, not block state.
float8_e4m3fn keeps 3 mantissa bits (a relative step of 1/8 to 1/16) from 2**-6 up to 448, so K/V
activations of usual magnitudes (about 0.01 to 100) keep about 2 significant digits with scale 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPE = jnp.float8_e4m3fn
MAX = float(jnp.finfo(DTYPE).max)  # 448
# Names of the fp8 KV cache dtype users may give (vLLM's): all are float8_e4m3fn.
NAMES = ("fp8", "fp8_e4m3")


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(DTYPE)


def quantize(x: jax.Array, scale: jax.Array | None) -> jax.Array:
    """x / scale, clipped to +-448 (saturating), as float8_e4m3fn. `scale` broadcasts against x (None: 1)."""
    x = x.astype(jnp.float32)
    if scale is not None:
        x = x / scale
    return jnp.clip(x, -MAX, MAX).astype(DTYPE)


def unit_scales(num_kv_heads: int) -> jax.Array:
    """[2, K] float32 ones: the scales of a cache whose checkpoint names none."""
    return jnp.ones((2, num_kv_heads), jnp.float32)
