"""Expert placement tables and the expert-parallel load balancer (EPLB). Host code: numpy only, no JAX.

Letters (beside the project's dimension alphabet, where E is experts): L MoE layers, n devices on the
`expert` mesh axis, G physical slots per device, n * G = num_slots, R the most replicas one expert may have.

A physical slot holds the weights of one logical expert (or nothing). Each device holds G consecutive
slots, so slot s lives on device s // G. The tables, one row per MoE layer:

    phys_to_logical [L, num_slots] int32   logical expert in each slot; -1 = empty (no token is sent there)
    logical_to_phys [L, E, R] int32        the slots holding each expert, -1 padded
    logical_count   [L, E] int32           replicas per expert, >= 1; a token picks replica
                                           logical_to_phys[l, e, token_index % logical_count[l, e]]

`Placement` carries the three tables plus the (static) device count. sharding/expert_parallel registers it
as a JAX pytree whose leaves are the tables, so a placement is a jit argument and every placement of the
same shapes runs the same compiled program: rebalancing is data.

    measured load [L, E] --rebalance--> new Placement (same shapes)
      per layer: replicate  num_slots - E extra replicas, each to argmax(load / replicas)
                 pack       replicas heaviest first, each onto the lightest device with a free slot,
                            so every device ends with exactly G slots
      kept only where it lowers max/mean device load below the current placement's

A device's load is the sum over its slots of load[e] / count[e] (a token's replica is chosen by its index,
which splits an expert's tokens evenly over its replicas).
"""

from __future__ import annotations

import dataclasses

import numpy as np

FILL_POLICIES = ("replicate", "empty")


def num_slots_for(num_experts: int, num_devices: int, num_redundant: int = 0) -> int:
    """Physical slots: num_experts + num_redundant rounded up to a multiple of the device count."""
    if num_experts < 1 or num_devices < 1 or num_redundant < 0:
        raise ValueError(f"num_experts={num_experts} and num_devices={num_devices} must be >= 1 and "
                         f"num_redundant={num_redundant} >= 0")
    wanted = num_experts + num_redundant
    return -(-wanted // num_devices) * num_devices


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Logical <-> physical expert tables of every MoE layer (see the module docstring)."""

    phys_to_logical: np.ndarray  # [L, num_slots] int32, -1 = empty slot
    logical_to_phys: np.ndarray  # [L, E, R] int32, -1 padded
    logical_count: np.ndarray  # [L, E] int32, >= 1
    num_devices: int  # devices on the expert axis (static: the same for every placement of a mesh)

    @property
    def num_layers(self) -> int:
        return self.phys_to_logical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phys_to_logical.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logical_count.shape[1]

    @property
    def slots_per_device(self) -> int:
        return self.num_slots // self.num_devices

    @classmethod
    def from_phys_to_logical(cls, phys_to_logical, num_experts: int, num_devices: int,
                             max_replicas: int | None = None) -> Placement:
        """The full tables from the slot -> expert map. max_replicas (R) defaults to the most any placement
        of these slots can need (num_slots - E + 1), so every rebalanced placement has the same shapes."""
        p2l = np.asarray(phys_to_logical, dtype=np.int32)
        if p2l.ndim != 2:
            raise ValueError(f"phys_to_logical must be [layers, slots], got shape {p2l.shape}")
        num_slots = p2l.shape[1]
        if max_replicas is None:
            max_replicas = max(1, num_slots - num_experts + 1)
        check_phys_to_logical(p2l, num_experts, num_devices, max_replicas)
        l2p = np.full((p2l.shape[0], num_experts, max_replicas), -1, np.int32)
        count = np.zeros((p2l.shape[0], num_experts), np.int32)
        for layer, row in enumerate(p2l):
            for slot, expert in enumerate(row):
                if expert >= 0:
                    l2p[layer, expert, count[layer, expert]] = slot
                    count[layer, expert] += 1
        return cls(p2l, l2p, count, num_devices)

    @classmethod
    def default(cls, num_layers: int, num_experts: int, num_devices: int, num_redundant: int = 0,
                fill: str = "replicate") -> Placement:
        """Experts 0..E-1 in slots 0..E-1 (consecutive experts share a device), for every layer. The
        slots past E (redundant ones, and those that round the count up to a multiple of the devices) hold
        copies of experts 0, 1, ... (fill="replicate") or stay empty (fill="empty")."""
        if fill not in FILL_POLICIES:
            raise ValueError(f"fill={fill!r}: use one of {FILL_POLICIES}")
        num_slots = num_slots_for(num_experts, num_devices, num_redundant)
        row = np.arange(num_slots)
        row = np.where(row < num_experts, row, row % num_experts if fill == "replicate" else -1)
        return cls.from_phys_to_logical(np.tile(row, (num_layers, 1)), num_experts, num_devices)


def check_phys_to_logical(p2l: np.ndarray, num_experts: int, num_devices: int, max_replicas: int) -> None:
    """Raise ValueError unless the slot map is a valid placement of num_experts over num_devices."""
    num_slots = p2l.shape[1]
    if num_slots % num_devices:
        raise ValueError(f"{num_slots} expert slots cannot be split over {num_devices} devices of the expert axis; "
                         f"use num_slots_for() to round the slot count up to a multiple of the devices")
    if p2l.min(initial=0) < -1 or p2l.max(initial=0) >= num_experts:
        raise ValueError(f"phys_to_logical holds ids outside [-1, {num_experts}): {np.unique(p2l)}")
    for layer, row in enumerate(p2l):
        count = np.bincount(row[row >= 0], minlength=num_experts)
        if count.min() < 1:
            raise ValueError(f"layer {layer}: experts {np.flatnonzero(count == 0).tolist()} have no slot; every "
                             f"expert needs at least one")
        if count.max() > max_replicas:
            raise ValueError(f"layer {layer}: an expert has {count.max()} replicas but max_replicas={max_replicas}")


def replicate(load: np.ndarray, num_slots: int, max_replicas: int | None = None) -> np.ndarray:
    """load [E] -> replicas [E], summing to num_slots: one each, then each extra replica to the expert with
    the highest load per replica (ties: the fewest replicas, then the lowest id), none past max_replicas."""
    num_experts = load.shape[0]
    max_replicas = num_slots - num_experts + 1 if max_replicas is None else max_replicas
    if num_slots < num_experts or num_slots > num_experts * max_replicas:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts with 1 to {max_replicas} "
                         f"replicas each; change the slot count or max_replicas")
    replicas = np.ones(num_experts, np.int64)
    for _ in range(num_slots - num_experts):
        per_replica = np.where(replicas < max_replicas, load / replicas, -1.0)
        best = np.flatnonzero(per_replica == per_replica.max())
        replicas[best[np.argmin(replicas[best])]] += 1
    return replicas


def pack(load: np.ndarray, replicas: np.ndarray, num_devices: int) -> np.ndarray:
    """Replicas onto devices -> phys_to_logical row [num_slots]: heaviest replica first, each onto the device
    with the least load that still has a free slot (ties: lowest device). Every device gets exactly G slots."""
    num_slots = int(replicas.sum())
    per_device = num_slots // num_devices
    experts = np.repeat(np.arange(load.shape[0]), replicas)
    weights = (load / replicas)[experts]
    order = np.argsort(-weights, kind="stable")
    device_load = np.zeros(num_devices)
    filled = np.zeros(num_devices, np.int64)
    row = np.full(num_slots, -1, np.int32)
    for index in order:
        room = np.flatnonzero(filled < per_device)
        device = room[np.argmin(device_load[room])]
        row[device * per_device + filled[device]] = experts[index]
        filled[device] += 1
        device_load[device] += weights[index]
    return row


def device_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """load [L, E] -> [L, n]: each device's share, an expert's load split evenly over its replicas."""
    load = np.asarray(load, np.float64)
    p2l = np.asarray(placement.phys_to_logical)
    count = np.asarray(placement.logical_count)
    layers = np.arange(p2l.shape[0])[:, None]
    safe = np.maximum(p2l, 0)
    per_slot = np.where(p2l >= 0, load[layers, safe] / count[layers, safe], 0.0)
    return per_slot.reshape(p2l.shape[0], placement.num_devices, -1).sum(-1)


def max_mean_device_load(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[L]: the busiest device's load over the mean device load, per layer (1.0 = balanced; a layer with no
    load counts as balanced)."""
    per_device = device_loads(load, placement)
    mean = per_device.mean(-1)
    return np.where(mean > 0, per_device.max(-1) / np.where(mean > 0, mean, 1.0), 1.0)


def rebalance(load: np.ndarray, current: Placement) -> Placement:
    """A placement for the measured load [L, E] with the current one's shapes (slots, devices, R), per layer
    never worse than `current` by max/mean device load."""
    load = np.asarray(load, np.float64)
    if load.shape != current.logical_count.shape:
        raise ValueError(f"load has shape {load.shape} but the placement has {current.logical_count.shape} "
                         f"[layers, experts]")
    if (load < 0).any():
        raise ValueError("expert load counts must be >= 0")
    max_replicas = current.logical_to_phys.shape[2]
    rows = np.stack([pack(layer_load, replicate(layer_load, current.num_slots, max_replicas), current.num_devices)
                     for layer_load in load])
    candidate = Placement.from_phys_to_logical(rows, current.num_experts, current.num_devices, max_replicas)
    better = max_mean_device_load(load, candidate) < max_mean_device_load(load, current)
    rows = np.where(better[:, None], rows, np.asarray(current.phys_to_logical))
    return Placement.from_phys_to_logical(rows, current.num_experts, current.num_devices, max_replicas)
