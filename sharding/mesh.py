"""Device meshes from the `parallel` config section.

    parallel {data, model} + devices --make_mesh--> Mesh [data, model], axes ("data", "model")
    --replica_meshes--> `data` meshes [1, model]: one per data-parallel engine replica, on disjoint devices

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


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A [data, model] mesh over the first data * model of `devices` (default: every device, of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"parallel.data and parallel.model must be >= 1, got data={data}, model={model}")
    needed = data * model
    if needed > len(devices):
        raise ValueError(f"parallel.data={data} x parallel.model={model} needs {needed} devices but only "
                         f"{len(devices)} are visible ({devices[0].platform}); lower parallel.data or parallel.model")
    return Mesh(np.array(devices[:needed], dtype=object).reshape(data, model), (DATA_AXIS, MODEL_AXIS))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One [1, model] mesh per row of the data axis: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[row: row + 1], mesh.axis_names) for row in range(mesh.shape[DATA_AXIS])]
