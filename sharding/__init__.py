"""Mesh construction, logical-axis rules and shard_map helpers (docs/ARCHITECTURE.md §7).

    mesh.py             parallel {data, model} -> Mesh [D, T]; one [1, T] mesh per data-parallel replica
    rules.py            logical axis names -> mesh axes (the one table), uneven-axis policies
    tensor_parallel.py  TensorParallel(mesh): sharded placement, shard_map, psum / all_gather / sharded_lookup
"""

from sharding.mesh import DATA_AXIS, MODEL_AXIS, make_mesh, replica_meshes
from sharding.rules import TENSOR_PARALLEL, AxisRules
from sharding.tensor_parallel import TensorParallel, all_gather, all_reduce_kernel, psum, sharded_lookup

__all__ = ["DATA_AXIS", "MODEL_AXIS", "AxisRules", "TENSOR_PARALLEL", "TensorParallel", "all_gather",
           "all_reduce_kernel", "make_mesh", "psum", "replica_meshes", "sharded_lookup"]
