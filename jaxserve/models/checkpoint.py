"""Orbax save/restore of a loaded params pytree, for fast restarts of converted weights.

    load_model(hf_dir) -> params --save_params--> orbax dir --restore_params(cfg)--> params

Restoring needs only the model config: shapes and dtypes come from its family's `abstract(cfg)`, and
`shardings` (a pytree of jax.sharding.Sharding matching the params) places each array directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxserve.models import registry

Params = Any  # a family's params pytree


def save_params(params: Params, directory: str | os.PathLike) -> None:
    directory = Path(directory).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, params)
        checkpointer.wait_until_finished()


def restore_params(cfg: Any, directory: str | os.PathLike, shardings=None) -> Params:
    target = registry.family_of(cfg).abstract(cfg)
    if shardings is not None:
        target = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                              target, shardings)
    else:
        device = jax.devices()[0]
        target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                               sharding=jax.sharding.SingleDeviceSharding(device)),
                              target)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(directory).absolute(), target)
