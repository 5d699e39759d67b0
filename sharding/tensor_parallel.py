"""Tensor parallelism over one mesh: sharded placement, and the shard_map helpers that model code
calls with logical axis names.

    host or device tensor [.., n, ..] --layout: pad / replicate by the rules--> [.., n', ..]
      --place: make_array_from_callback, each device gets only its slice--> jax.Array on its NamedSharding
    a model step --TensorParallel.shard_map--> the per-device function on local shards, which calls
      psum (after a row-parallel matmul), all_gather (logits), sharded_lookup (vocab-parallel embedding)

psum is XLA's all-reduce unless the TensorParallel carries an `all_reduce` kernel (a static, hashable
callable `(x, comm) -> sum` with `fits(x)`, e.g. pallas_kernels.all_reduce.OneShotAllReduce) and the
step passes that kernel's device-side state `comm` (its local shard, sharded over "model"): then
every all-reduce the kernel takes (decode-sized ones) runs it, the rest stay XLA's. A kernel may also
offer `fits_rms_norm(x)` / `add_rms_norm(partial, residual, weight, eps, comm)`, the all-reduce fused
with the residual add and RMSNorm after it (`all_reduce_kernel` hands it to the model code), and
`gather_size(x, shards, axis)`, with which all_gather runs small gathers as sums into zeros.

With `expert` (sharding/expert_parallel.ExpertSharding) the mesh is [expert, model] and the rules are
EXPERT_PARALLEL: MoE layers shard their experts' physical slots over "expert" (`layout` puts an "experts"
axis into slot order first) and everything else runs data-parallel over it (llama.forward).

`TensorParallel` is frozen and hashable, so it is a static argument of the jitted step. The
in-shard helpers take `tp=None` on the unsharded path and then return the plain computation: the
single-device step has no shard_map and no collectives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sharding.mesh import MODEL_AXIS
from sharding.rules import TENSOR_PARALLEL, AxisRules

Axes = tuple[str | None, ...]  # logical names of a tensor's axes; () for a replicated prefix


def _is_axes(node: Any) -> bool:
    return isinstance(node, tuple) and all(name is None or isinstance(name, str) for name in node)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    mesh: Mesh
    rules: AxisRules = TENSOR_PARALLEL
    all_reduce: Any = None  # a kernel over the "model" axis for the all-reduces it fits; None: XLA's psum
    expert: Any = None  # expert_parallel.ExpertSharding when the mesh has an "expert" axis; None: no EP

    @property
    def size(self) -> int:
        """Shards of the tensor-parallel ("model") axis: parallel.model, "tp" below."""
        return self.mesh.shape.get(MODEL_AXIS, 1)

    @property
    def expert_size(self) -> int:
        """Shards of the expert axis (1 without expert parallelism)."""
        return self.mesh.shape[self.expert.axis] if self.expert is not None else 1

    def shards(self, logical: str | None) -> int:
        axis = self.rules.mesh_axis(logical)
        return 1 if axis is None else self.mesh.shape[axis]

    def global_size(self, logical: str | None, size: int, name: str = "tensor") -> int:
        """The size of an axis of `size` entries once laid out for sharding (padded or replicated)."""
        shards = self.shards(logical)
        if size % shards == 0:
            return size
        policy = self.rules.uneven_policy(logical)
        if policy == "pad":
            return -(-size // shards) * shards
        if policy == "replicate" and shards % size == 0:
            return shards
        axis = self.rules.mesh_axis(logical)
        need = "divide" if policy != "replicate" else "divide or be a multiple of"
        raise ValueError(f"{name}: its {logical!r} axis has {size} entries, which cannot be sharded over the "
                         f"{shards} devices of mesh axis {axis!r}; parallel.{axis} must {need} {size}")

    def local_size(self, logical: str | None, size: int, name: str = "tensor") -> int:
        """Entries of the axis that each device holds."""
        return self.global_size(logical, size, name) // self.shards(logical)

    def spec(self, logical_axes: Axes):
        return self.rules.spec(logical_axes)

    def sharding(self, logical_axes: Axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    def layout(self, array, logical_axes: Axes, name: str = "tensor"):
        """Pad or replicate the axes the shards do not divide (numpy stays numpy, jax stays jax)."""
        xp = np if isinstance(array, np.ndarray) else jnp
        if array.ndim != len(logical_axes):
            raise ValueError(f"{name}: {array.ndim} dims but logical axes {logical_axes}")
        for dim, logical in enumerate(logical_axes):
            if logical == "experts" and self.expert is not None:  # logical experts -> physical slots
                array = xp.take(array, self.expert.slot_experts(array.shape[dim], self.expert_size), axis=dim)
            size = array.shape[dim]
            target = self.global_size(logical, size, name)
            if target == size:
                continue
            if self.rules.uneven_policy(logical) == "pad":
                widths = [(0, 0)] * array.ndim
                widths[dim] = (0, target - size)
                array = xp.pad(array, widths)
            else:  # replicate: entry i onto shards i * r .. i * r + r - 1
                array = xp.repeat(array, target // size, axis=dim)
        return array

    def place(self, array, logical_axes: Axes, name: str = "tensor") -> jax.Array:
        """A host (or single-device) tensor -> its sharded jax.Array; each device receives only its slice."""
        array = self.layout(array, logical_axes, name)
        return jax.make_array_from_callback(array.shape, self.sharding(logical_axes), lambda index: array[index])

    def zeros(self, shape: tuple[int, ...], dtype, logical_axes: Axes = ()) -> jax.Array:
        """Zeros made in place on every device (each allocates only its shard), e.g. KV caches;
        `logical_axes=()` replicates them."""
        return zeros(shape, dtype, self.sharding(logical_axes))

    def shard_map(self, fn: Callable, in_axes, out_axes) -> Callable:
        """`jax.shard_map` over the mesh; in/out specs given as pytrees of logical axes (prefixes allowed)."""
        def specs(tree):
            return jax.tree.map(self.spec, tree, is_leaf=_is_axes)
        # NOTE: check_vma=False: the Pallas attention kernels run inside the map and carry no
        # varying-axes annotations; the out specs below are replicated only where psum/all_gather made them so.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(in_axes), out_specs=specs(out_axes),
                             check_vma=False)


def zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """Zeros made on the devices of `sharding` (each allocating only its shard), by one compiled fill
    per shape: no host transfer, and no tracing once a shape has been made."""
    return _zeros_fn(tuple(shape), np.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=256)
def _zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _axis_name(tp: TensorParallel | None, logical: str) -> str | None:
    if tp is None:
        return None
    axis = tp.rules.mesh_axis(logical)
    return axis if axis is not None and tp.mesh.shape[axis] > 1 else None


def psum(x: jax.Array, tp: TensorParallel | None, logical: str, comm: jax.Array | None = None) -> jax.Array:
    """Inside shard_map: sum the partial results of a matmul that contracted the sharded `logical` axis.
    With `comm` (the local shard of `tp.all_reduce`'s state) the kernel sums the tensors it fits."""
    axis = _axis_name(tp, logical)
    if axis is None:
        return x
    kernel = all_reduce_kernel(tp, logical, comm)
    if kernel is not None and kernel.fits(x):
        return kernel(x, comm)
    return jax.lax.psum(x, axis)


def all_reduce_kernel(tp: TensorParallel | None, logical: str, comm: jax.Array | None):
    """tp's all-reduce kernel where a sum over `logical` may run it (the kernel's state `comm` is given and
    the axis is the model axis), else None: callers with a fused variant (models' residual add + norm)
    ask it which tensors it takes."""
    if comm is None or tp is None or tp.all_reduce is None or _axis_name(tp, logical) != MODEL_AXIS:
        return None
    return tp.all_reduce


def all_gather(x: jax.Array, tp: TensorParallel | None, logical: str, axis: int,
               comm: jax.Array | None = None) -> jax.Array:
    """Inside shard_map: concatenate every shard's slice of the `logical` axis (dim `axis` of x). With
    `comm`, a small gather along the last axis runs tp's all-reduce kernel: each shard adds its slice,
    at its offset, into zeros (exact), which keeps the step one CUDA graph (XLA's all-gather is not
    captured, and makes the devices' host threads meet every step)."""
    name = _axis_name(tp, logical)
    if name is None:
        return x
    kernel = all_reduce_kernel(tp, logical, comm)
    shards = tp.mesh.shape[name]
    gather_size = getattr(kernel, "gather_size", None)
    width = gather_size(x, shards, axis) if gather_size is not None else None
    if width is None:
        return jax.lax.all_gather(x, name, axis=axis, tiled=True)
    local = x.shape[-1]
    full = jnp.zeros((*x.shape[:-1], width), x.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index(name) * local, axis=x.ndim - 1)
    return kernel(full, comm)[..., : local * shards]


def sharded_lookup(table: jax.Array, ids: jax.Array, tp: TensorParallel | None, logical: str,
                   comm: jax.Array | None = None) -> jax.Array:
    """table[ids] for a table whose rows (the `logical` axis) are sharded: each shard looks up the ids
    it holds, zeros elsewhere, and one psum assembles the rows (exact: one nonzero term per row)."""
    axis = _axis_name(tp, logical)
    if axis is None:
        return table[ids]
    rows = table.shape[0]
    local = ids - jax.lax.axis_index(axis) * rows
    held = (local >= 0) & (local < rows)
    found = table[jnp.where(held, local, 0)]
    return psum(jnp.where(held[..., None], found, jnp.zeros((), table.dtype)), tp, logical, comm)
