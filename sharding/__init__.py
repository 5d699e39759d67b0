"""Mesh construction, logical-axis rules and shard_map helpers (docs/ARCHITECTURE.md §7).

    mesh.py             parallel {data, model} -> Mesh [D, T]; one [1, T] mesh per data-parallel replica
                        (an [expert, model] mesh per replica with expert parallelism)
    rules.py            logical axis names -> mesh axes (the tables), uneven-axis policies
    tensor_parallel.py  TensorParallel(mesh): sharded placement, shard_map, psum / all_gather / sharded_lookup
    expert_parallel.py  MoE dispatch/combine over the expert axis, placement tables as data (imported by name)
"""

from sharding.mesh import DATA_AXIS, EXPERT_AXIS, MODEL_AXIS, expert_mesh, make_mesh, replica_meshes
from sharding.rules import EXPERT_PARALLEL, TENSOR_PARALLEL, AxisRules
from sharding.tensor_parallel import TensorParallel, all_gather, all_reduce_kernel, psum, sharded_lookup

__all__ = ["DATA_AXIS", "EXPERT_AXIS", "EXPERT_PARALLEL", "MODEL_AXIS", "AxisRules", "TENSOR_PARALLEL",
           "TensorParallel", "all_gather", "all_reduce_kernel", "expert_mesh", "make_mesh", "psum", "replica_meshes",
           "sharded_lookup"]
