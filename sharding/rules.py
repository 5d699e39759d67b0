"""Logical axis names -> mesh axes: the one table that says how parameters and caches are sharded.

Model code names every tensor axis logically ("vocab", "embed", "heads", ...) and never spells a
mesh axis; `AxisRules.spec` turns a tuple of logical names into a PartitionSpec. To try another
strategy, change the table.

An axis that a rule shards but whose size the shards do not divide is laid out by its `uneven`
policy, or refused:
    pad        zero entries appended up to a multiple of the shards (exact for vocabulary rows,
               whose padded logits are cut off, and for MLP and expert columns: silu(0) * 0 = 0)
    replicate  fewer entries than shards: entry i copied onto shards // size consecutive shards
               (GQA kv heads when num_kv_heads < parallel.model, so each shard holds its query heads' kv head)
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

from sharding.mesh import EXPERT_AXIS, MODEL_AXIS

UNEVEN_POLICIES = ("pad", "replicate")


@dataclasses.dataclass(frozen=True)
class AxisRules:
    mapping: tuple[tuple[str, str | None], ...]  # logical axis -> mesh axis (None: every device holds all of it)
    uneven: tuple[tuple[str, str], ...] = ()  # logical axis -> "pad" | "replicate"

    def __post_init__(self):
        names = [name for name, _ in self.mapping]
        if len(set(names)) != len(names):
            raise ValueError(f"AxisRules.mapping names a logical axis twice: {names}")
        for name, policy in self.uneven:
            if policy not in UNEVEN_POLICIES or name not in names:
                raise ValueError(f"AxisRules.uneven entry ({name!r}, {policy!r}): the policy must be one of "
                                 f"{UNEVEN_POLICIES} and the axis one of {names}")

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        for name, mesh_axis in self.mapping:
            if name == logical:
                return mesh_axis
        raise KeyError(f"logical axis {logical!r} has no sharding rule; add it to the AxisRules table "
                       f"(known: {[name for name, _ in self.mapping]})")

    def uneven_policy(self, logical: str | None) -> str | None:
        return dict(self.uneven).get(logical)

    def spec(self, logical_axes: tuple[str | None, ...]) -> PartitionSpec:
        """Logical names of a tensor's axes -> its PartitionSpec; a mesh axis may shard one axis only."""
        mesh_axes = [self.mesh_axis(name) for name in logical_axes]
        used = [axis for axis in mesh_axes if axis is not None]
        if len(set(used)) != len(used):
            raise ValueError(f"logical axes {logical_axes} map onto mesh axes {mesh_axes}: a mesh axis can shard "
                             "only one axis of a tensor; fix the AxisRules table")
        return PartitionSpec(*mesh_axes)


# Megatron-style tensor parallelism: heads, kv heads, MLP columns and the vocabulary split over
# "model"; the model width ("embed") and everything per head stays whole on every device. MoE
# layers: every device holds every expert ("experts"), each with its share of the expert's
# columns ("expert_mlp", and "shared_mlp" for the shared expert), like the dense MLP.
TENSOR_PARALLEL = AxisRules(
    mapping=(("vocab", MODEL_AXIS), ("embed", None), ("heads", MODEL_AXIS), ("kv_heads", MODEL_AXIS),
             ("head_dim", None), ("mlp", MODEL_AXIS), ("pages", None), ("page_slots", None),
             ("tp_shard", MODEL_AXIS), ("experts", None), ("expert_logits", None), ("expert_mlp", MODEL_AXIS),
             ("shared_mlp", MODEL_AXIS)),
    uneven=(("vocab", "pad"), ("mlp", "pad"), ("kv_heads", "replicate"), ("expert_mlp", "pad"),
            ("shared_mlp", "pad")),
)

# Expert parallelism (a replica's mesh [expert, model]): as TENSOR_PARALLEL over "model", and the experts'
# physical slots ("experts": the loader lays them out by slot, a multiple of the expert devices) split over
# "expert". "expert_shard" is the leading axis of what each expert shard owns alone: its step's batch, its
# KV cache and its logits (attention and dense layers run data-parallel over the expert axis).
EXPERT_PARALLEL = AxisRules(
    mapping=tuple((name, EXPERT_AXIS if name == "experts" else axis) for name, axis in TENSOR_PARALLEL.mapping)
    + (("expert_shard", EXPERT_AXIS),),
    uneven=TENSOR_PARALLEL.uneven,
)
