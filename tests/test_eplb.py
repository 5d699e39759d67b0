"""The expert load balancer and placement tables (jaxserve/core/eplb.py), host only.

- tables: default placements (even, uneven, redundant, empty slots) and the logical <-> physical inverse;
  bad slot maps are refused with a message.
- rebalance, as properties on random skewed loads: every expert keeps >= 1 replica, replicas fill exactly
  the slots, every device holds exactly its slots, the shapes never change, and max/mean device load
  never gets worse; and a skew that redundant slots can fix falls to <= 1.15.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.eplb import Placement, max_mean_device_load, num_slots_for, pack, rebalance, replicate

pytestmark = pytest.mark.cpu_test


def check_tables(placement: Placement) -> None:
    p2l, l2p, count = placement.phys_to_logical, placement.logical_to_phys, placement.logical_count
    for layer in range(placement.num_layers):
        assert (count[layer] >= 1).all()
        for expert in range(placement.num_experts):
            held = l2p[layer, expert]
            assert (held[count[layer, expert]:] == -1).all()
            assert sorted(held[: count[layer, expert]]) == np.flatnonzero(p2l[layer] == expert).tolist()


@pytest.mark.parametrize("experts, devices, redundant, fill, row", [
    (8, 4, 0, "replicate", [0, 1, 2, 3, 4, 5, 6, 7]),
    (6, 4, 0, "replicate", [0, 1, 2, 3, 4, 5, 0, 1]),  # uneven: rounded up to 8 slots, copies of 0 and 1
    (6, 4, 0, "empty", [0, 1, 2, 3, 4, 5, -1, -1]),
    (6, 2, 2, "replicate", [0, 1, 2, 3, 4, 5, 0, 1]),
    (3, 8, 0, "replicate", [0, 1, 2, 0, 1, 2, 0, 1]),  # fewer experts than devices
])
def test_default_placement(experts, devices, redundant, fill, row):
    placement = Placement.default(2, experts, devices, redundant, fill=fill)
    assert placement.num_slots == num_slots_for(experts, devices, redundant) == len(row)
    assert (placement.phys_to_logical == np.array([row, row])).all()
    assert placement.logical_to_phys.shape == (2, experts, len(row) - experts + 1)
    check_tables(placement)


def test_bad_slot_maps_are_refused():
    with pytest.raises(ValueError, match="experts \\[2\\] have no slot"):
        Placement.from_phys_to_logical([[0, 1, 0, 1]], 3, 2)
    with pytest.raises(ValueError, match="cannot be split over 4 devices"):
        Placement.from_phys_to_logical([[0, 1, 2, 0, 1, 2]], 3, 4)
    with pytest.raises(ValueError, match="outside"):
        Placement.from_phys_to_logical([[0, 1, 2, 7]], 3, 2)
    with pytest.raises(ValueError, match="max_replicas=1"):
        Placement.from_phys_to_logical([[0, 1, 2, 0]], 3, 2, max_replicas=1)
    with pytest.raises(ValueError, match="fill='spread'"):
        Placement.default(1, 4, 2, fill="spread")
    with pytest.raises(ValueError, match="\\[layers, experts\\]"):
        rebalance(np.ones((2, 5)), Placement.default(2, 4, 2))


def test_replicate_gives_the_hottest_expert_per_replica():
    assert replicate(np.array([8.0, 4.0, 1.0]), 6).tolist() == [3, 2, 1]  # 8/3, 4/2, 1/1
    assert replicate(np.zeros(3), 6).tolist() == [2, 2, 2]  # ties: fewest replicas first
    assert replicate(np.array([9.0, 1.0]), 4, max_replicas=2).tolist() == [2, 2]


def test_pack_puts_heaviest_first_onto_the_lightest_device():
    row = pack(np.array([10.0, 6.0, 5.0, 1.0]), np.ones(4, np.int64), 2)
    assert sorted(row[:2].tolist()) == [0, 3] and sorted(row[2:].tolist()) == [1, 2]  # 11 and 11


@st.composite
def skewed_problem(draw):
    devices = draw(st.sampled_from([1, 2, 4, 8]))
    experts = draw(st.integers(1, 24))
    redundant = draw(st.integers(0, 12))
    layers = draw(st.integers(1, 3))
    skew = draw(st.floats(0.0, 3.0))  # Zipf-like exponent: 0 is uniform
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    load = np.stack([rng.permutation((np.arange(1, experts + 1) ** -skew) * 1000) for _ in range(layers)])
    load = np.floor(load * rng.uniform(0.5, 1.5, load.shape))
    fill = draw(st.sampled_from(["replicate", "empty"]))
    return load, Placement.default(layers, experts, devices, redundant, fill=fill)


@settings(max_examples=150, deadline=None)
@given(skewed_problem())
def test_rebalance_properties(problem):
    load, current = problem
    new = rebalance(load, current)
    check_tables(new)
    for name in ("phys_to_logical", "logical_to_phys", "logical_count"):
        assert getattr(new, name).shape == getattr(current, name).shape  # same compiled program
    assert new.num_devices == current.num_devices
    per_device = new.phys_to_logical.reshape(new.num_layers, new.num_devices, -1)
    assert per_device.shape[2] == current.slots_per_device  # exactly G slots on every device
    changed = (new.phys_to_logical != current.phys_to_logical).any(1)
    assert (new.phys_to_logical[changed] >= 0).all()  # a new plan uses every slot
    assert (new.logical_count.sum(1)[changed] == new.num_slots).all()
    assert (max_mean_device_load(load, new) <= max_mean_device_load(load, current) + 1e-12).all()


def test_redundant_slots_fix_a_skewed_workload():
    # 16 experts on 8 devices (2 each), two of them eight times hotter than the rest: without redundancy
    # the two hot devices carry 2.4x the mean. 8 redundant slots (3 per device) give each hot expert 5
    # replicas of 160 beside 14 of 100, which pack as (160, 160, 100) x 5 and (100, 100, 100) x 3.
    load = np.full((1, 16), 100.0)
    load[0, [3, 11]] = 800.0
    current = Placement.default(1, 16, 8, num_redundant=8)
    before = max_mean_device_load(load, Placement.default(1, 16, 8))
    assert before[0] == pytest.approx(2.4)
    new = rebalance(load, current)
    assert max_mean_device_load(load, new)[0] <= 1.15
    assert new.logical_count[0, 3] > 1 and new.logical_count[0, 11] > 1
