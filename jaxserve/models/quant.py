"""FP8 weights: their representation in the params pytree, the one place a weight meets an activation
(`linear`), and the conversions into that representation (online quantization, checkpoint scales).

    Fp8Weight(q, scale, block)   q: float8_e4m3fn in the weight's own shape and `x @ W` layout;
                                 scale: float32 of the same rank, one entry per `block[a]` entries of q
                                 along each axis a: w ~= q * scale, scale repeated `block` times per axis

An axis with block 1 is "full": scale holds one entry per q entry along it and carries q's logical axis,
so tensor parallelism shards scale exactly as it shards q (sharding/rules.py, `scale_axes`). Every other
axis of scale is unsharded (logical None): per-output-channel scales put the input axes there (scale size
1, broadcast), block scales the model-width ("embed") axis, which no dense weight shards. Block scales
of a checkpoint (HF [out, in] blocks) are repeated to per-entry along the other side when loaded: the
side that tensor parallelism may shard (heads, MLP columns) then holds one scale per row or column, at
4 / block bytes per weight (3% of the FP8 bytes for 128-wide blocks).

`linear(x, w, subscripts)` is every dense matmul of the model: a plain array runs today's einsum (or
`x @ w`), an Fp8Weight is dequantized in the step ((q as float32 * scale) in x's dtype) and runs the same
one. A checkpoint's static activation scales are not applied. On a GPU, weights with per-channel scales
take two faster paths: a decode-sized step runs the FP8 GEMM kernel (pallas_kernels/fp8_gemm/gpu.py:
weight-only, the fp8 bytes streamed and widened in registers); a larger one quantizes its rows to fp8 per
token and multiplies on the FP8 tensor cores (`w8a8`, vLLM's dynamic per-token scheme). Block scales
dequantize.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.tree_util import GetAttrKey

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
CHECKPOINT_FORMATS = ("online", "compressed-tensors", "fp8")


@jax.tree_util.register_pytree_with_keys_class
class Fp8Weight:
    """A quantized weight: leaves `q` and `scale`, static `block` (module docstring). Any leaf type is
    allowed, so the same node holds arrays, ShapeDtypeStructs (abstract params) or logical axes."""

    __slots__ = ("q", "scale", "block")

    def __init__(self, q, scale, block: tuple[int, ...]):
        self.q, self.scale, self.block = q, scale, tuple(block)

    def tree_flatten_with_keys(self):
        return ((GetAttrKey("q"), self.q), (GetAttrKey("scale"), self.scale)), self.block

    def tree_flatten(self):
        return (self.q, self.scale), self.block

    @classmethod
    def tree_unflatten(cls, block, children):
        return cls(*children, block)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def __repr__(self):
        return f"Fp8Weight(q={self.q!r}, scale={self.scale!r}, block={self.block})"


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a model's dense weights are quantized (part of the static model config).

    `checkpoint`: online (a float checkpoint quantized at load, per output channel) | compressed-tensors |
    fp8 (the checkpoint holds float8_e4m3fn weights and the scale tensor `scale_name`). `block`: the
    checkpoint's weight block [out, in] (block-wise scales), None for per-channel or per-tensor scales
    (a per-tensor scale is held per channel)."""

    checkpoint: str = "online"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"  # the scale tensor beside each `weight`: weight_scale | weight_scale_inv

    def __post_init__(self):
        if self.checkpoint not in CHECKPOINT_FORMATS:
            raise ValueError(f"QuantSpec.checkpoint must be one of {CHECKPOINT_FORMATS}, got {self.checkpoint!r}")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"a weight block must be two positive sizes [out, in], got {self.block}")


# ------------------------------------------------------------------------------------------------ compute

def shape(w) -> tuple[int, ...]:
    """The weight's logical shape, quantized or not."""
    return tuple(w.shape)


def _expand(scale: jax.Array, q_shape: tuple[int, ...], block: tuple[int, ...]) -> jax.Array:
    """scale repeated up to q's shape along its blocked axes (size-1 axes are left to broadcast)."""
    for axis, (n, count) in enumerate(zip(q_shape, scale.shape)):
        if count not in (1, n):
            scale = jax.lax.slice_in_dim(jnp.repeat(scale, block[axis], axis=axis), 0, n, axis=axis)
    return scale


def dequantize(w, dtype) -> jax.Array:
    """An Fp8Weight -> the weight in `dtype` ((q as float32 * scale), rounded once); a plain array as is."""
    if not isinstance(w, Fp8Weight):
        return w
    scale = _expand(w.scale.astype(jnp.float32), w.q.shape, w.block)
    return (w.q.astype(jnp.float32) * scale).astype(dtype)


def linear(x: jax.Array, w, subscripts: str | None = None, *, kernel: bool | None = None) -> jax.Array:
    """x times the weight w: `jnp.einsum(subscripts, x, w)`, or `x @ w` without subscripts. The weight is
    a plain array (the model dtype) or an Fp8Weight with per-channel scales: on a GPU a decode-sized step
    runs the FP8 GEMM kernel (pallas_kernels/fp8_gemm: the fp8 bytes streamed, widened in registers) and a
    larger one runs FP8 on the tensor cores (`_fp8_tensor_cores`); block scales, and every weight off a
    GPU, are dequantized to x's dtype first. `kernel`: force the decode kernel's choice (None: the platform
    decides; tests run the kernel in interpret mode on a CPU with True)."""
    if isinstance(w, Fp8Weight):
        if kernel is not False and (y := _fp8_kernel(x, w, subscripts, kernel)) is not None:
            return y
        if kernel is None and (y := _fp8_tensor_cores(x, w, subscripts)) is not None:
            return y
        w = dequantize(w, x.dtype)
    return x @ w if subscripts is None else jnp.einsum(subscripts, x, w)


def _matrix_form(x: jax.Array, w: Fp8Weight, subscripts: str | None) -> tuple[int, int] | None:
    """(K, N) when the product is x [T, K] times w's q flattened to [K, N] with one scale per output column
    (subscripts like "td,dnh->tnh": x contracts w's one leading axis); None otherwise."""
    if subscripts is not None:
        inputs, out = subscripts.split("->")
        lhs, rhs = inputs.split(",")
        if not (len(lhs) == 2 and lhs[-1] == rhs[0] and out == lhs[:-1] + rhs[1:]):
            return None
    q = w.q
    if x.ndim != 2 or w.block != (q.shape[0], *(1,) * (q.ndim - 1)) or w.scale.shape[0] != 1:
        return None
    return q.shape[0], math.prod(q.shape[1:])


def _fp8_kernel(x: jax.Array, w: Fp8Weight, subscripts: str | None, forced: bool | None) -> jax.Array | None:
    """x @ w through the FP8 GEMM kernel, or None where it does not apply: not a GPU (unless forced), not
    the matrix form (`_matrix_form`), or shapes the kernel does not take (T above its rows, K or N off its
    blocks)."""
    if forced is None and jax.default_backend() != "gpu":
        return None
    if (form := _matrix_form(x, w, subscripts)) is None:
        return None
    from pallas_kernels.fp8_gemm import gpu  # noqa: PLC0415 - the Triton backend loads where it runs
    (k, n), q = form, w.q
    if not gpu.supported(x.shape[0], k, n):
        return None
    y = gpu.fp8_matmul(x, q.reshape(k, n), w.scale.reshape(n), interpret=forced is True and
                       jax.default_backend() != "gpu")
    return y.reshape(x.shape[0], *q.shape[1:])


def tensor_cores_apply(num_rows: int) -> bool:
    """Whether a step of `num_rows` rows multiplies FP8 weights on the tensor cores: on a GPU, above the
    decode kernel's rows (tests patch this to run the path on a CPU)."""
    from pallas_kernels.fp8_gemm import gpu  # noqa: PLC0415
    return jax.default_backend() == "gpu" and num_rows > gpu.MAX_ROWS


def w8a8(x: jax.Array, q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [T, K] @ (q [K, N] fp8 * w_scale [N]) with x quantized to fp8 per row (W8A8, dynamic per-token
    activation scales): xq = fp8(x / s), s = max|x_row| / FP8_MAX; the fp8 x fp8 product accumulates in
    float32 and is scaled by s x w_scale -> [T, N] in x's dtype. XLA lowers the fp8 dot to the GPU's FP8
    tensor-core GEMM."""
    xf = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / FP8_MAX
    xq = (xf / x_scale).astype(FP8_DTYPE)
    y = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale * w_scale.astype(jnp.float32)[None, :]).astype(x.dtype)


def _fp8_tensor_cores(x: jax.Array, w: Fp8Weight, subscripts: str | None) -> jax.Array | None:
    """x @ w as W8A8 (`w8a8`) for prefill-sized steps on a GPU (`tensor_cores_apply`), or None where it
    does not apply (another platform, a decode-sized step, not the matrix form)."""
    if x.ndim != 2 or not tensor_cores_apply(x.shape[0]) or (form := _matrix_form(x, w, subscripts)) is None:
        return None
    k, n = form
    return w8a8(x, w.q.reshape(k, n), w.scale.reshape(n)).reshape(x.shape[0], *w.q.shape[1:])


def merge_leading(w, count: int):
    """The weight with its first `count` axes merged into one (e.g. wo [N, H, D] -> [N*H, D]); for an
    Fp8Weight each merged scale axis must be all full or all broadcast."""
    if not isinstance(w, Fp8Weight):
        return w.reshape(math.prod(w.shape[:count]), *w.shape[count:])
    q = w.q.reshape(math.prod(w.q.shape[:count]), *w.q.shape[count:])
    lead = w.scale.shape[:count]
    if all(b == 1 for b in w.block[:count]):
        merged, block = math.prod(lead), 1
    elif all(size == 1 for size in lead):
        merged, block = 1, q.shape[0]
    else:
        raise ValueError(f"cannot merge weight axes with blocks {w.block[:count]} and scale {lead}")
    return Fp8Weight(q, w.scale.reshape(merged, *w.scale.shape[count:]), (block, *w.block[count:]))


# --------------------------------------------------------------------------------------- representation

def layout(spec: QuantSpec, shape: tuple[int, ...], axes: tuple, n_in: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(scale shape, block) of a weight of `shape` with logical `axes`, whose first `n_in` axes are its
    input (contracted) axes. Per channel: input axes broadcast. Block [bo, bi]: the "embed" side blocked
    (the input for column-parallel weights, the output for row-parallel ones), the other side full."""
    if spec.block is None:
        block = (*shape[:n_in], *(1,) * (len(shape) - n_in))
    elif tuple(axes[n_in:]) == ("embed",):
        block = (*(1,) * n_in, spec.block[0])
    elif tuple(axes[:n_in]) == ("embed",):
        block = (spec.block[1], *(1,) * (len(shape) - n_in))
    else:
        raise ValueError(f"block-wise FP8 needs the weight's input or output to be the model width; axes {axes}")
    return tuple(-(-n // b) for n, b in zip(shape, block)), block


def abstract(spec: QuantSpec, shape: tuple[int, ...], axes: tuple, n_in: int) -> Fp8Weight:
    scale_shape, block = layout(spec, shape, axes, n_in)
    return Fp8Weight(jax.ShapeDtypeStruct(shape, FP8_DTYPE), jax.ShapeDtypeStruct(scale_shape, jnp.float32), block)


def scale_axes(axes: tuple, block: tuple[int, ...]) -> tuple:
    """The scale's logical axes: q's along full axes, None (unsharded) along blocked or broadcast ones."""
    return tuple(name if b == 1 else None for name, b in zip(axes, block))


def quantize(w, n_in: int):
    """A float weight in `x @ W` layout (numpy on the host, or a jax array) -> Fp8Weight with one scale per
    output channel: amax over the first `n_in` (input) axes / 448."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    amax = xp.max(xp.abs(w32), axis=tuple(range(n_in)), keepdims=True)
    scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)
    q = xp.clip(w32 / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn if xp is np else FP8_DTYPE)
    return Fp8Weight(q, scale, (*w.shape[:n_in], *(1,) * (w.ndim - n_in)))


def from_checkpoint(spec: QuantSpec, q_hf: np.ndarray, scale_hf: np.ndarray, like: Fp8Weight, n_in: int,
                    name: str) -> Fp8Weight:
    """A checkpoint's FP8 weight [out, in] and its scale (per-tensor [] / [1], per-channel [out] / [out, 1],
    or blocks [ceil(out / bo), ceil(in / bi)]; multiplied in every format) -> the Fp8Weight laid out as
    `like` (its abstract leaf: HF's weight transposed, then reshaped; `n_in` leading input axes).
    ValueError naming `name` on a scale that fits none of these."""
    out_dim, in_dim = q_hf.shape
    q = np.ascontiguousarray(np.swapaxes(q_hf, 0, 1)).reshape(like.q.shape)
    s = np.asarray(scale_hf, np.float32)
    if spec.block is None:
        if s.size == 1:
            s = np.full((out_dim,), s.reshape(()), np.float32)
        elif s.shape not in ((out_dim,), (out_dim, 1)):
            raise ValueError(f"{name}: scale shape {list(s.shape)} is neither per-tensor [1] nor per-channel "
                             f"[{out_dim}, 1]")
        return Fp8Weight(q, s.reshape(like.scale.shape), like.block)
    bo, bi = spec.block
    if s.shape != (-(-out_dim // bo), -(-in_dim // bi)):
        raise ValueError(f"{name}: block scale shape {list(s.shape)} does not match weight [{out_dim}, {in_dim}] "
                         f"with weight_block_size [{bo}, {bi}]")
    if all(b == 1 for b in like.block[n_in:]):  # the output side is held per channel
        s = np.repeat(s, bo, axis=0)[:out_dim]
    if all(b == 1 for b in like.block[:n_in]):  # the input side is held per row
        s = np.repeat(s, bi, axis=1)[:, :in_dim]
    return Fp8Weight(q, np.ascontiguousarray(s.T).reshape(like.scale.shape), like.block)


def dummy(key: jax.Array, like: Fp8Weight, std: float) -> Fp8Weight:
    """Random FP8 weights laid out as `like` whose values are about normal * std (dummy weights)."""
    q = jnp.clip(jax.random.normal(key, like.q.shape, jnp.float32) * (FP8_MAX / 8), -FP8_MAX, FP8_MAX)
    return Fp8Weight(q.astype(FP8_DTYPE), jnp.full(like.scale.shape, std * 8 / FP8_MAX, jnp.float32), like.block)
