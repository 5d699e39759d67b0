"""FP8 weights: their representation in the params pytree, the one place a weight meets an activation
(`linear`), and the conversions into that representation (online quantization, checkpoint scales).

    Fp8Weight(q, scale, block)   q: float8_e4m3fn in the weight's own shape and `x @ W` layout;
                                 scale: float32 of the same rank, one entry per `block[a]` entries of q
                                 along each axis a: w ~= q * scale, scale repeated `block` times per axis
    Fp8Weight(q, scale, block, transposed_shape)
                                 the same weight (of shape `transposed_shape`, per-channel scales) with q
                                 held as [N, K]: the transpose of its matrix form [K, N], the input axes
                                 flattened to K and the output axes to N (`hold_transposed`)

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
take faster paths, by how q is held:

    [N, K] (a single-device engine on a Hopper GPU: runner/device_setup.py holds them so at load)
        decode-sized step (<= DECODE_ROWS rows): rows quantized to fp8 per token, then the W8A8 Mosaic GPU
            kernel (pallas_kernels/fp8_gemm/mosaic_gpu.py: fp8 x fp8 wgmma, whose 8-bit operands must
            both be K-major)
        larger step, or shapes the kernel does not take: `w8a8` (the FP8 tensor cores through XLA)
    the weight's own layout (tensor or expert parallelism, other GPUs, other model dtypes)
        decode-sized step: the weight-only Triton kernel (pallas_kernels/fp8_gemm/gpu.py: the fp8 bytes
            streamed and widened in registers)
        larger step: `w8a8`

`w8a8` and the Mosaic kernel quantize rows alike (vLLM's dynamic per-token scheme). Block scales, and every
weight off a GPU, dequantize.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.tree_util import GetAttrKey

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
CHECKPOINT_FORMATS = ("online", "compressed-tensors", "fp8")
DECODE_ROWS = 64  # steps of at most this many rows run the decode kernels (_fp8_kernel)


@jax.tree_util.register_pytree_with_keys_class
class Fp8Weight:
    """A quantized weight: leaves `q` and `scale`, static `block` and `transposed_shape` (module docstring).
    Any leaf type is allowed, so the same node holds arrays, ShapeDtypeStructs (abstract params) or logical
    axes. `scale` and `block` are in the weight's own shape whether or not q is held transposed."""

    __slots__ = ("q", "scale", "block", "transposed_shape")

    def __init__(self, q, scale, block: tuple[int, ...], transposed_shape: tuple[int, ...] | None = None):
        self.q, self.scale, self.block = q, scale, tuple(block)
        self.transposed_shape = None if transposed_shape is None else tuple(transposed_shape)

    def tree_flatten_with_keys(self):
        return ((GetAttrKey("q"), self.q), (GetAttrKey("scale"), self.scale)), (self.block, self.transposed_shape)

    def tree_flatten(self):
        return (self.q, self.scale), (self.block, self.transposed_shape)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, *static)

    @property
    def transposed(self) -> bool:
        """Whether q holds the weight as [N, K], the transpose of its matrix form."""
        return self.transposed_shape is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's own shape (q's, unless q is held transposed)."""
        return self.transposed_shape if self.transposed_shape is not None else tuple(self.q.shape)

    def __repr__(self):
        held = f", transposed_shape={self.transposed_shape}" if self.transposed else ""
        return f"Fp8Weight(q={self.q!r}, scale={self.scale!r}, block={self.block}{held})"


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


def _expand(scale: jax.Array, shape: tuple[int, ...], block: tuple[int, ...]) -> jax.Array:
    """scale repeated up to the weight's shape along its blocked axes (size-1 axes are left to broadcast)."""
    for axis, (n, count) in enumerate(zip(shape, scale.shape)):
        if count not in (1, n):
            scale = jax.lax.slice_in_dim(jnp.repeat(scale, block[axis], axis=axis), 0, n, axis=axis)
    return scale


def dequantize(w, dtype) -> jax.Array:
    """An Fp8Weight -> the weight in its own shape and `dtype` ((q as float32 * scale), rounded once); a
    plain array as is."""
    if not isinstance(w, Fp8Weight):
        return w
    q = w.q.T.reshape(w.shape) if w.transposed else w.q
    scale = _expand(w.scale.astype(jnp.float32), w.shape, w.block)
    return (q.astype(jnp.float32) * scale).astype(dtype)


def linear(x: jax.Array, w, subscripts: str | None = None, *, kernel: bool | None = None) -> jax.Array:
    """x times the weight w: `jnp.einsum(subscripts, x, w)`, or `x @ w` without subscripts. The weight is
    a plain array (the model dtype) or an Fp8Weight: on a GPU a decode-sized step with per-channel scales
    runs a decode kernel (`_fp8_kernel`) and the other steps FP8 on the tensor cores (`_fp8_tensor_cores`);
    block scales, and every weight off a GPU, are dequantized to x's dtype first (module docstring).
    `kernel`: force the decode kernel's choice (None: the platform decides; tests run the kernel in
    interpret mode on a CPU with True)."""
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
    shape = w.shape
    if x.ndim != 2 or w.block != (shape[0], *(1,) * (len(shape) - 1)) or w.scale.shape[0] != 1:
        return None
    return shape[0], math.prod(shape[1:])


def _fp8_kernel(x: jax.Array, w: Fp8Weight, subscripts: str | None, forced: bool | None) -> jax.Array | None:
    """x @ w through a decode kernel, or None where none applies: not a GPU (unless forced), more than
    DECODE_ROWS rows, not the matrix form (`_matrix_form`), or what the kernel does not take. q held
    [N, K]: the W8A8 Mosaic GPU kernel (bfloat16 x; K a multiple of 128, N of 64); q in its own layout:
    the weight-only Triton kernel (K and N multiples of its blocks)."""
    on_gpu = jax.default_backend() == "gpu"
    if (forced is None and not on_gpu) or x.ndim != 2 or x.shape[0] > DECODE_ROWS:
        return None
    if (form := _matrix_form(x, w, subscripts)) is None:
        return None
    (k, n), rows = form, x.shape[0]
    if w.transposed:
        from pallas_kernels.fp8_gemm import mosaic_gpu  # noqa: PLC0415 - Mosaic GPU loads where it runs
        config = mosaic_gpu.choose_config(rows, k, n)
        if config is None or x.dtype != jnp.bfloat16:  # (the kernel writes bfloat16)
            return None
        y = mosaic_gpu.fp8_gemv(x, w.q, w.scale.reshape(n), config=config, interpret=not on_gpu)
    else:
        from pallas_kernels.fp8_gemm import gpu  # noqa: PLC0415 - the Triton backend loads where it runs
        if not gpu.supported(rows, k, n):
            return None
        y = gpu.fp8_matmul(x, w.q.reshape(k, n), w.scale.reshape(n), interpret=not on_gpu)
    return y.reshape(rows, *w.shape[1:])


def tensor_cores_apply(num_rows: int, w: Fp8Weight) -> bool:
    """Whether a step of `num_rows` rows multiplies FP8 weight w on the tensor cores (`w8a8`): on a GPU,
    past the decode kernels' rows, and for a weight held [N, K] every step its decode kernel does not take
    (dequantizing it would transpose the whole weight). Tests patch this to run the path on a CPU."""
    return jax.default_backend() == "gpu" and (num_rows > DECODE_ROWS or w.transposed)


def w8a8(x: jax.Array, q: jax.Array, w_scale: jax.Array, *, transposed: bool = False) -> jax.Array:
    """x [T, K] @ (q [K, N] fp8 * w_scale [N]), or q [N, K] with `transposed`, with x quantized to fp8 per
    row as the Mosaic decode kernel quantizes it (W8A8, dynamic per-token activation scales: xq =
    fp8(x * (FP8_MAX / max|x_row|)), x_scale = max|x_row| / FP8_MAX; mosaic_gpu.quantize_rows); the fp8 x
    fp8 product accumulates in float32 and is scaled by x_scale x w_scale -> [T, N] in x's dtype. XLA
    lowers the fp8 dot to the GPU's FP8 tensor-core GEMM, which reads both operands K-major: q [N, K]
    as it is held."""
    from pallas_kernels.fp8_gemm.mosaic_gpu import quantize_rows  # noqa: PLC0415
    xq, x_scale = quantize_rows(x, x.shape[0])
    contract = ((1,), (1 if transposed else 0,))
    y = jax.lax.dot_general(xq, q, (contract, ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale[:, None] * w_scale.astype(jnp.float32)[None, :]).astype(x.dtype)


def _fp8_tensor_cores(x: jax.Array, w: Fp8Weight, subscripts: str | None) -> jax.Array | None:
    """x @ w as W8A8 (`w8a8`) where `tensor_cores_apply` says so, or None (another platform, a step a
    decode kernel takes, not the matrix form)."""
    if x.ndim != 2 or not tensor_cores_apply(x.shape[0], w) or (form := _matrix_form(x, w, subscripts)) is None:
        return None
    k, n = form
    q = w.q if w.transposed else w.q.reshape(k, n)
    return w8a8(x, q, w.scale.reshape(n), transposed=w.transposed).reshape(x.shape[0], *w.shape[1:])


def merge_leading(w, count: int):
    """The weight with its first `count` axes merged into one (e.g. wo [N, H, D] -> [N*H, D]); for an
    Fp8Weight each merged scale axis must be all full or all broadcast. A q held [N, K] stays as it is:
    merging leading axes changes neither the matrix form's K nor its N."""
    if not isinstance(w, Fp8Weight):
        return w.reshape(math.prod(w.shape[:count]), *w.shape[count:])
    shape = (math.prod(w.shape[:count]), *w.shape[count:])
    q = w.q if w.transposed else w.q.reshape(shape)
    lead = w.scale.shape[:count]
    if all(b == 1 for b in w.block[:count]):
        merged, block = math.prod(lead), 1
    elif all(size == 1 for size in lead):
        merged, block = 1, shape[0]
    else:
        raise ValueError(f"cannot merge weight axes with blocks {w.block[:count]} and scale {lead}")
    return Fp8Weight(q, w.scale.reshape(merged, *w.scale.shape[count:]), (block, *w.block[count:]),
                     shape if w.transposed else None)


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


def _input_size(w: Fp8Weight) -> int | None:
    """K, the size of w's input axes flattened, where w has one scale per output channel: for some j >= 1,
    block (*shape[:j], 1, ...) and scale (1,) * j + shape[j:] (e.g. wo [N, H, D]: j = 2); None for block
    scales."""
    shape, scale = w.shape, tuple(w.scale.shape)
    for j in range(1, len(shape)):
        if w.block == (*shape[:j], *(1,) * (len(shape) - j)) and scale == (*(1,) * j, *shape[j:]):
            return math.prod(shape[:j])
    return None


@functools.partial(jax.jit, static_argnums=1)
def _transpose(q: jax.Array, k: int) -> jax.Array:
    return q.reshape(k, -1).T


def hold_transposed(w):
    """An Fp8Weight with per-output-channel scales -> the same weight with q held as [N, K] (K contiguous),
    the transpose of its matrix form [K, N], made by one jitted transpose where q lives; anything else (a
    plain array, block scales, a weight held so already) as it is."""
    if not isinstance(w, Fp8Weight) or w.transposed or (k := _input_size(w)) is None:
        return w
    return Fp8Weight(_transpose(w.q, k), w.scale, w.block, w.shape)


def fuse_outputs(weights: list) -> Fp8Weight | None:
    """Weights held [N_i, K] (hold_transposed) with per-output-channel scales over one input of size K, e.g.
    a layer's wq, wk and wv -> one weight held [sum N_i, K] (matrix form [K, sum N_i]) whose output columns
    are theirs in order: x @ it is one kernel where there were len(weights), x quantized once. None where any
    weight is not so held or the inputs differ."""
    if not all(isinstance(w, Fp8Weight) and w.transposed for w in weights):
        return None
    sizes = {_input_size(w) for w in weights}
    if len(sizes) != 1 or (k := sizes.pop()) is None:
        return None
    n = sum(w.q.shape[0] for w in weights)
    return Fp8Weight(jnp.concatenate([w.q for w in weights]),
                     jnp.concatenate([w.scale.reshape(1, -1) for w in weights], axis=1), (k, 1), (k, n))
