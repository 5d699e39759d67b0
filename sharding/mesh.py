"""Device meshes from the `parallel` config section.

    parallel {data, model} + devices --make_mesh--> Mesh [data, model], axes ("data", "model")
    --replica_meshes--> `data` meshes [1, model]: one per data-parallel engine replica, on disjoint devices
    parallel.expert > 1: a replica's devices --expert_mesh--> Mesh [expert, model], axes ("expert", "model")

Tensor parallelism runs over "model" (consecutive devices, so a tensor-parallel group that fits in
one host stays in it); data-parallel replicas are separate engines, one per row of the grid.
(Mesh sizes are spelled out: in the dimension alphabet D and T mean model width and tokens.)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
EXPERT_AXIS = "expert"  # expert parallelism: MoE experts sharded over it, attention data-parallel over it


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None, expert: int = 1) -> Mesh:
    """A [data, expert * model] mesh over the first data * expert * model of `devices` (default: every device,
    of every process); each row is one replica's devices (`expert_mesh` shapes them when expert > 1)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or expert < 1:
        raise ValueError(f"parallel.data, parallel.expert and parallel.model must be >= 1, got data={data}, "
                         f"expert={expert}, model={model}")
    needed = data * expert * model
    if needed > len(devices):
        shape = f"parallel.data={data} x parallel.model={model}" if expert == 1 else (
            f"parallel.data={data} x parallel.expert={expert} x parallel.model={model}")
        lower = "parallel.data or parallel.model" if expert == 1 else "parallel.data, parallel.expert or parallel.model"
        raise ValueError(f"{shape} needs {needed} devices but only {len(devices)} are visible ({devices[0].platform}); "
                         f"lower {lower}")
    return Mesh(np.array(devices[:needed], dtype=object).reshape(data, expert * model), (DATA_AXIS, MODEL_AXIS))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One [1, model] mesh per row of the data axis: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[row: row + 1], mesh.axis_names) for row in range(mesh.shape[DATA_AXIS])]


def expert_mesh(devices: Sequence[jax.Device], expert: int, model: int) -> Mesh:
    """One replica's `expert * model` devices as a Mesh [expert, model] (a tensor-parallel group stays
    consecutive devices, as in make_mesh)."""
    devices = list(devices)
    if len(devices) != expert * model:
        raise ValueError(f"parallel.expert={expert} x parallel.model={model} needs {expert * model} devices per "
                         f"replica, got {len(devices)}")
    return Mesh(np.array(devices, dtype=object).reshape(expert, model), (EXPERT_AXIS, MODEL_AXIS))
