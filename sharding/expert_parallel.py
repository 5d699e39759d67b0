"""Expert parallelism: MoE dispatch and combine over the `expert` mesh axis, with placement tables as data.

Letters: the project alphabet (T tokens, D model, F ffw, E logical experts) plus k (experts per token),
n (devices on the expert axis), G (physical expert slots per device; n * G slots in all), L (MoE layers),
M (rows of a static dispatch buffer). T_loc = T / n tokens live on each device: attention is data-parallel
over the expert axis, so each device brings its own tokens and gets their MoE output back.

Placement (jaxserve.core.eplb.Placement, registered here as a pytree of its three int32 tables, so it is a
jit ARGUMENT and swapping it compiles nothing): slot s holds logical expert phys_to_logical[l, s] and lives
on device s // G. A token t sends its expert e to replica t % logical_count[l, e] (`choose_replica`, t the
global token index): deterministic, and it splits a replicated expert's tokens evenly.

Per-device bodies (call them inside a shard_map over the expert axis, or through `ExpertParallel.moe`):

  path A, ep_moe_allgather (tokens gathered, experts local, results scattered back):
    x [T_loc, D], ids/weights [T_loc, k] --all_gather--> [T, D], [T, k]
      --choose_replica--> slot [T, k] --keep slots on this device, stable sort by local slot-->
      rows [T*k, D] grouped by slot, group_sizes [G] --expert_fn--> [T*k, D]
      --unsort, weight, sum over k (f32)--> [T, D] partial --psum_scatter--> out [T_loc, D]

  path B, ep_moe_all_to_all (only the routed rows travel):
    slot [T_loc, k] --stable sort by slot (= by device, then local slot)--> rows [T_loc*k, D]
      all_to_all  per-slot counts [n, G] + my send offsets            (receiver learns sizes and row slots)
      all_to_all  receive offsets + rows that fit in M [n, 2]          (sender learns where and how much)
      ragged_all_to_all  rows --> buffer [M, D] --sort by local slot--> expert_fn --unsort-->
      ragged_all_to_all  results back (the transpose) --> [T_loc*k, D] --unsort, weight, sum over k (f32)-->
      out [T_loc, D]
    M: dropless n * T_loc * min(k, G) by default, or capacity_factor * T_loc * k; rows past M are dropped
    (their contribution is zero) and the device reports `overflow`.

Traffic per device per MoE layer (bytes ~ rows x D, each way): A gathers and scatters T*D*(n-1)/n; B sends
about T_loc*k*D*(n-1)/n = T*k*D*(n-1)/n^2. So B moves less only when n > k, and it needs four collectives
(two tiny) to A's two: `choose_path` takes A when n <= k or when a device has few tokens (latency-bound).

`expert_fn(x_rows [M, D], group_sizes [G] int32, local_weights) -> [M, D]` is the grouped expert FFN over
this device's G slots (rows sorted by slot; rows past sum(group_sizes) are padding and their output is
ignored, so kernels that leave them unwritten are fine). Padding tokens (`valid` False) and ids < 0 send
nothing, count no load and get zero output. A token's k ids must be distinct (top-k gives that); path B's
dropless bound relies on it, and a violation only drops rows, never writes out of bounds.

Load: every call returns this device's tokens' count per logical expert, [E] int32, on device (no host
sync). Summed over devices (and steps) it is the measured load that jaxserve.core.eplb.rebalance takes.

Weight moves: expert weights are stored by physical slot, [L, n*G, ...] (or [n*G, ...] per layer) sharded
over the expert axis. `ExpertParallel.apply_placement` builds the new layout from the old in one jitted,
donated program (a ring of ppermutes, one layer at a time) whose shapes do not depend on the placement.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxserve.core.eplb import Placement
from sharding.mesh import EXPERT_AXIS
from sharding.ragged_all_to_all import ragged_all_to_all

ALLGATHER = "allgather"
ALL_TO_ALL = "all_to_all"
PATHS = (ALLGATHER, ALL_TO_ALL)
# Path A below this many tokens per device: the step is latency-bound and A has half B's collectives.
# A starting point; the crossover is a measurement per platform and mesh.
FEW_TOKENS = 32

ExpertFn = Callable[[jax.Array, jax.Array, Any], jax.Array]

jax.tree_util.register_dataclass(
    Placement, data_fields=["phys_to_logical", "logical_to_phys", "logical_count"], meta_fields=["num_devices"])

__all__ = ["ALLGATHER", "ALL_TO_ALL", "EXPERT_AXIS", "EPOutput", "ExpertParallel", "ExpertSharding", "Placement",
           "capacity_rows",
           "choose_path", "choose_replica", "count_load", "ep_moe", "ep_moe_all_to_all", "ep_moe_allgather",
           "source_slots"]


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """How an engine's step runs its MoE layers over the expert axis (sharding.TensorParallel.expert; static,
    hashable). `dispatch`: "auto" (choose_path on the step's static shapes), ALLGATHER or ALL_TO_ALL.
    `num_redundant`: slots beyond one per expert (rounded up to a multiple of the expert devices), which the
    default placement fills with copies of experts 0, 1, ... and a rebalance gives to hot experts."""

    num_redundant: int = 0
    dispatch: str = "auto"
    axis: str = EXPERT_AXIS

    def __post_init__(self):
        if self.dispatch not in ("auto", *PATHS):
            raise ValueError(f"parallel.expert_dispatch={self.dispatch!r}: use auto, {ALLGATHER} or {ALL_TO_ALL}")
        if self.num_redundant < 0:
            raise ValueError(f"parallel.num_redundant_experts must be >= 0, got {self.num_redundant}")

    @property
    def path(self) -> str | None:
        return None if self.dispatch == "auto" else self.dispatch

    def default_placement(self, num_layers: int, num_experts: int, num_devices: int) -> Placement:
        return Placement.default(num_layers, num_experts, num_devices, self.num_redundant)

    def slot_experts(self, num_experts: int, num_devices: int) -> np.ndarray:
        """[num_slots]: the logical expert in each physical slot of the default placement (the layout the
        loader places expert weights in)."""
        return self.default_placement(1, num_experts, num_devices).phys_to_logical[0]


class EPOutput(NamedTuple):
    out: jax.Array  # [T_loc, D] in x's dtype; zero for padding tokens
    load: jax.Array  # [E] int32: this device's tokens per logical expert
    overflow: jax.Array  # bool []: path B dropped rows past its capacity (always False for path A)


def choose_path(num_devices: int, top_k: int, tokens_per_device: int, few_tokens: int = FEW_TOKENS) -> str:
    """ALLGATHER when it moves no more bytes than the all-to-all (n <= k) or the step is latency-bound
    (few tokens per device), else ALL_TO_ALL. See the module docstring for the arithmetic."""
    if num_devices <= top_k or tokens_per_device <= few_tokens:
        return ALLGATHER
    return ALL_TO_ALL


def choose_replica(placement: Placement, layer, ids: jax.Array, token_index: jax.Array) -> jax.Array:
    """ids [T, k] logical experts, token_index [T] global -> [T, k] physical slots: replica
    token_index % logical_count (deterministic). Ids outside [0, E) give an arbitrary slot; mask them."""
    ids = jnp.clip(ids, 0, placement.num_experts - 1)
    replica = token_index[:, None] % placement.logical_count[layer][ids]
    return placement.logical_to_phys[layer][ids, replica]


def count_load(ids: jax.Array, live: jax.Array, num_experts: int) -> jax.Array:
    """[E] int32: live (token, expert) pairs per logical expert."""
    return jnp.zeros(num_experts, jnp.int32).at[ids.reshape(-1)].add(live.reshape(-1).astype(jnp.int32),
                                                                     mode="drop")


def _live(ids: jax.Array, valid: jax.Array | None) -> jax.Array:
    live = ids >= 0
    return live if valid is None else live & valid[:, None]


def _inverse(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _weighted_sum(per_row: jax.Array, weights: jax.Array, keep: jax.Array, dtype) -> jax.Array:
    """per_row [T*k, D] in token-major order, weights/keep [T, k] -> [T, D]: sum over k in float32."""
    tokens, k = weights.shape
    w = jnp.where(keep, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkd->td", w, per_row.reshape(tokens, k, -1).astype(jnp.float32)).astype(dtype)


def _grouped(expert_fn: ExpertFn, x: jax.Array, row_source: jax.Array, local_slot: jax.Array, slots: int,
             expert_weights):
    """Rows x[row_source] [M, D] with local slot ids [M] (`slots` = padding) -> expert outputs [M, D] in the
    same row order, zero for padding rows."""
    order = jnp.argsort(local_slot, stable=True)
    group_sizes = jnp.bincount(local_slot, length=slots + 1)[:slots].astype(jnp.int32)
    y = expert_fn(x[row_source[order]], group_sizes, expert_weights)
    y = jnp.where((jnp.arange(local_slot.shape[0]) < group_sizes.sum())[:, None], y, 0)
    return y[_inverse(order)]


def ep_moe_allgather(x: jax.Array, ids: jax.Array, weights: jax.Array, expert_weights, placement: Placement,
                     layer, *, expert_fn: ExpertFn, axis: str = EXPERT_AXIS,
                     valid: jax.Array | None = None) -> EPOutput:
    """Path A, per device: x [T_loc, D], ids/weights [T_loc, k], expert_weights this device's G slots
    ([G, ...] leaves), valid [T_loc] bool or None. See the module docstring."""
    n, k = lax.axis_size(axis), ids.shape[1]
    slots = placement.num_slots // n
    live = _live(ids, valid)
    all_x, all_ids, all_weights, all_live = (lax.all_gather(a, axis, tiled=True) for a in (x, ids, weights, live))
    tokens = all_x.shape[0]
    local = choose_replica(placement, layer, all_ids, jnp.arange(tokens)) - lax.axis_index(axis) * slots
    mine = all_live & (local >= 0) & (local < slots)
    local_slot = jnp.where(mine, local, slots).reshape(-1)  # [T*k]
    y = _grouped(expert_fn, all_x, jnp.arange(tokens * k) // k, local_slot, slots, expert_weights)
    # NOTE: the partial sums are reduced in x's dtype (half an f32 reduction's bytes); each token's output
    # adds at most min(k, n) partials, each summed over its k experts in f32.
    partial = _weighted_sum(y, all_weights, mine, x.dtype)  # [T, D]: the sum over this device's slots
    out = lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)
    return EPOutput(out, count_load(ids, live, placement.num_experts), jnp.zeros((), bool))


def capacity_rows(num_devices: int, tokens_per_device: int, top_k: int, slots_per_device: int,
                  capacity_factor: float | None = None) -> int:
    """Path B's receive buffer M: dropless n * T_loc * min(k, G), or ceil(capacity_factor * T_loc * k)
    (the mean rows per device is T_loc * k), never above dropless."""
    dropless = num_devices * tokens_per_device * min(top_k, slots_per_device)
    if capacity_factor is None:
        return dropless
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for a dropless buffer)")
    return max(1, min(dropless, math.ceil(capacity_factor * tokens_per_device * top_k)))


def ep_moe_all_to_all(x: jax.Array, ids: jax.Array, weights: jax.Array, expert_weights, placement: Placement,
                      layer, *, expert_fn: ExpertFn, axis: str = EXPERT_AXIS, valid: jax.Array | None = None,
                      capacity_factor: float | None = None, platform: str | None = None) -> EPOutput:
    """Path B, per device (arguments as ep_moe_allgather). platform picks XLA's ragged_all_to_all or the
    CPU emulator (default: jax.default_backend())."""
    n, device = lax.axis_size(axis), lax.axis_index(axis)
    tokens, k = ids.shape
    slots, num_slots = placement.num_slots // n, placement.num_slots
    rows = capacity_rows(n, tokens, k, slots, capacity_factor)
    live = _live(ids, valid)
    slot = choose_replica(placement, layer, ids, device * tokens + jnp.arange(tokens))
    key = jnp.where(live, slot, num_slots).reshape(-1)  # [T_loc*k]; dead rows sort last and are not sent
    order = jnp.argsort(key, stable=True)
    slot_counts = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32).reshape(n, slots)
    send = slot_counts.sum(1)
    send_offsets = jnp.cumsum(send) - send

    # 1) each receiver learns, per sender, its rows per local slot and where they start in the sender
    header = lax.all_to_all(jnp.concatenate([slot_counts, send_offsets[:, None]], 1), axis, 0, 0, tiled=True)
    recv_slot_counts, peer_send_offsets = header[:, :slots], header[:, slots]
    recv = recv_slot_counts.sum(1)
    recv_offsets = jnp.cumsum(recv) - recv
    recv_kept = jnp.clip(rows - recv_offsets, 0, recv)  # the buffer's M rows, first come first kept
    # 2) each sender learns where its rows land and how many fit
    reply = lax.all_to_all(jnp.stack([recv_offsets, recv_kept], 1), axis, 0, 0, tiled=True)
    out_offsets, send_kept = reply[:, 0], reply[:, 1]

    exchange = functools.partial(ragged_all_to_all, axis_name=axis, platform=platform)
    received = exchange(x[order // k], jnp.zeros((rows, x.shape[1]), x.dtype), send_offsets, send_kept,
                        out_offsets, recv_kept)  # [M, D]
    # The local slot of buffer row m: its sender's chunk, its place in that chunk, the chunk's slot bounds.
    index = jnp.arange(rows)
    source = jnp.minimum(jnp.searchsorted(jnp.cumsum(recv_kept), index, side="right"), n - 1)
    place = index - recv_offsets[source]
    local_slot = (place[:, None] >= jnp.cumsum(recv_slot_counts, 1)[source]).sum(1)
    local_slot = jnp.where(index < recv_kept.sum(), local_slot, slots)
    y = _grouped(expert_fn, received, index, local_slot, slots, expert_weights)
    returned = exchange(y, jnp.zeros((tokens * k, x.shape[1]), y.dtype), recv_offsets, recv_kept,
                        peer_send_offsets, send_kept)  # [T_loc*k, D] in sorted order; dropped rows stay zero
    out = _weighted_sum(returned[_inverse(order)], weights, live, x.dtype)
    return EPOutput(out, count_load(ids, live, placement.num_experts), recv.sum() > rows)


def ep_moe(x, ids, weights, expert_weights, placement: Placement, layer, *, expert_fn: ExpertFn,
           axis: str = EXPERT_AXIS, valid=None, path: str | None = None, capacity_factor: float | None = None,
           platform: str | None = None) -> EPOutput:
    """Per device: path A or B (`path`, default `choose_path` on the static shapes)."""
    path = path or choose_path(lax.axis_size(axis), ids.shape[1], ids.shape[0])
    if path == ALLGATHER:
        return ep_moe_allgather(x, ids, weights, expert_weights, placement, layer, expert_fn=expert_fn, axis=axis,
                                valid=valid)
    if path == ALL_TO_ALL:
        return ep_moe_all_to_all(x, ids, weights, expert_weights, placement, layer, expert_fn=expert_fn, axis=axis,
                                 valid=valid, capacity_factor=capacity_factor, platform=platform)
    raise ValueError(f"path={path!r}: use one of {PATHS} or None (chosen by choose_path)")


def source_slots(old: Placement, new: Placement) -> jax.Array:
    """[L, num_slots] int32: for each slot of `new`, an `old` slot holding the same expert (-1: empty slot)."""
    p2l = new.phys_to_logical
    layers = jnp.arange(p2l.shape[0])[:, None]
    return jnp.where(p2l >= 0, old.logical_to_phys[layers, jnp.maximum(p2l, 0), 0], -1)


def _move_slots(weights: jax.Array, source: jax.Array, *, axis: str) -> jax.Array:
    """Per device: weights [L, G, ...] (this device's old slots), source [L, n*G] -> this device's new slots.
    The devices' slot blocks travel once round a ring (n - 1 ppermutes per layer); each device keeps the
    rows its new slots need as they pass. One layer's block is in flight at a time."""
    n, device = lax.axis_size(axis), lax.axis_index(axis)
    slots = weights.shape[1]
    mine = lax.dynamic_slice_in_dim(source, device * slots, slots, axis=1)  # [L, G] global old slots
    ring = [(i, (i + 1) % n) for i in range(n)]

    def pick(held, owner, wanted, new):  # take the wanted rows that `held` (owner's old block) has
        local = wanted - owner * slots
        take = (wanted >= 0) & (local >= 0) & (local < slots)
        rows = held[jnp.clip(local, 0, slots - 1)]
        return jnp.where(take.reshape(-1, *[1] * (held.ndim - 1)), rows, new)

    def layer_step(layer, weights):
        held, wanted = weights[layer], mine[layer]
        new = pick(held, device, wanted, jnp.zeros_like(held))

        def ring_step(step, carry):
            held, new = carry
            held = lax.ppermute(held, axis, ring)
            return held, pick(held, (device - step) % n, wanted, new)

        _, new = lax.fori_loop(1, n, ring_step, (held, new))
        return weights.at[layer].set(new)

    return lax.fori_loop(0, weights.shape[0], layer_step, weights)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The expert axis of a mesh: global-array entry points for the per-device bodies above. Frozen and
    hashable (a static argument). Other mesh axes (e.g. "model" for the expert FFN's F) are the business of
    expert_fn and weight_specs."""

    mesh: Mesh
    axis: str = EXPERT_AXIS

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def moe(self, x, ids, weights, expert_weights, placement: Placement, layer, valid=None, *,
            expert_fn: ExpertFn, path: str | None = None, capacity_factor: float | None = None,
            weight_specs=None) -> EPOutput:
        """Global arrays: x [T, D], ids/weights [T, k], valid [T] or None (T sharded over the expert axis),
        expert_weights [n*G, ...] leaves sharded over it on axis 0 (or by weight_specs, a pytree prefix of
        PartitionSpecs), placement and layer replicated. Returns EPOutput with out [T, D], load [n, E]
        (per device: sum over axis 0 for the total) and overflow [n]."""
        if placement.num_devices != self.size:
            raise ValueError(f"the placement is for {placement.num_devices} expert devices but mesh axis "
                             f"{self.axis!r} has {self.size}; build it with num_devices={self.size}")
        spec = PartitionSpec(self.axis)
        valid = jnp.ones(x.shape[0], bool) if valid is None else valid
        layer = jnp.asarray(layer, jnp.int32)

        def body(x, ids, weights, valid, expert_weights, placement, layer):
            result = ep_moe(x, ids, weights, expert_weights, placement, layer, expert_fn=expert_fn, axis=self.axis,
                            valid=valid, path=path, capacity_factor=capacity_factor, platform=self.platform)
            return EPOutput(result.out, result.load[None], result.overflow[None])

        # NOTE: check_vma=False: expert_fn may run Pallas kernels, which carry no varying-axes annotations.
        mapped = jax.shard_map(body, mesh=self.mesh, check_vma=False,
                               in_specs=(spec, spec, spec, spec, weight_specs or spec, PartitionSpec(),
                                         PartitionSpec()),
                               out_specs=EPOutput(spec, spec, spec))
        return mapped(x, ids, weights, valid, expert_weights, placement, layer)

    def apply_placement(self, expert_weights, old: Placement, new: Placement, layer=None):
        """Expert weights laid out for `old` -> laid out for `new` (same shapes and sharding; the input is
        donated). Leaves are [L, n*G, ...] (every layer), or [n*G, ...] when `layer` names the placements' row
        (traced: one program for every layer). One compiled program serves every pair of placements."""
        if layer is None:
            return _apply_placement_fn(self.mesh, self.axis, True)(expert_weights, old, new, jnp.int32(0))
        return _apply_placement_fn(self.mesh, self.axis, False)(expert_weights, old, new, jnp.asarray(layer, jnp.int32))


@functools.lru_cache(maxsize=16)
def _apply_placement_fn(mesh: Mesh, axis: str, layered: bool):
    def move(expert_weights, old, new, layer):
        source = source_slots(old, new)
        if not layered:
            source = source[layer][None]
            expert_weights = jax.tree.map(lambda w: w[None], expert_weights)
        moved = jax.shard_map(
            lambda w, src: jax.tree.map(functools.partial(_move_slots, source=src, axis=axis), w), mesh=mesh,
            in_specs=(PartitionSpec(None, axis), PartitionSpec()), out_specs=PartitionSpec(None, axis),
            check_vma=False)(expert_weights, source)
        return moved if layered else jax.tree.map(lambda w: w[0], moved)

    return jax.jit(move, donate_argnums=0)
