"""Expert parallelism on 8 fake CPU devices (sharding/expert_parallel.py): EP == a dense per-token loop.

- both paths (A all-gather + psum_scatter, B ragged all-to-all through the CPU emulator) on expert axes of
  1, 2, 4 and 8 devices and a 2 x 2 (expert x model) mesh, with uneven expert counts (6 experts on 4
  devices), redundant slots, empty slots, a rebalanced placement and padding tokens; the per-device load
  counts sum to the routed (token, expert) pairs.
- path B with a small capacity drops whole (token, expert) contributions and says so.
- the ragged all-to-all emulator follows the documented contract (JAX's docstring example).
- a placement swap: the weights move with one jitted program, and after one warm-up two more placements
  compile nothing while the outputs stay equal to the dense reference.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.core.eplb import Placement, rebalance
from sharding.expert_parallel import (ALL_TO_ALL, ALLGATHER, ExpertParallel, capacity_rows, choose_path,
                                      choose_replica)
from sharding.ragged_all_to_all import ragged_all_to_all_emulated

D, F, K, LAYERS, TOKENS_PER_DEVICE = 8, 16, 2, 2, 3


@pytest.fixture(autouse=True, scope="module")
def eight_devices():
    if jax.default_backend() != "cpu":
        pytest.skip("the expert-parallel tests run on fake CPU devices")
    if jax.device_count() < 8:
        pytest.fail(f"{jax.device_count()} CPU devices: JAX started before XLA_FLAGS asked for 8")


def expert_fn(x, group_sizes, weights, model_axis=None):
    """The grouped gated FFN: x [M, D], weights ([G, D, 2, F], [G, F, D]) -> [M, D]."""
    gate_up, down = weights
    slots, width, _, ffw = gate_up.shape
    gu = jax.lax.ragged_dot(x, gate_up.reshape(slots, width, 2 * ffw), group_sizes).reshape(-1, 2, ffw)
    y = jax.lax.ragged_dot(jax.nn.silu(gu[:, 0]) * gu[:, 1], down, group_sizes)
    return y if model_axis is None else jax.lax.psum(y, model_axis)


def dense_reference(x, ids, weights, valid, gate_up, down):
    """A loop over tokens and their experts, float64: x [T, D], logical gate_up [E, D, 2, F], down [E, F, D]."""
    out = np.zeros(x.shape)
    for t, j in itertools.product(range(x.shape[0]), range(ids.shape[1])):
        expert = ids[t, j]
        if valid[t] and expert >= 0:
            gate, up = np.einsum("d,dcf->cf", x[t], gate_up[expert])
            out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ down[expert])
    return out


def physical(logical, placement: Placement):
    """Logical weights [L, E, ...] -> by physical slot [L, num_slots, ...] (empty slots zero)."""
    p2l = placement.phys_to_logical
    rows = logical[np.arange(LAYERS)[:, None], np.maximum(p2l, 0)]
    return np.where((p2l >= 0).reshape(*p2l.shape, *[1] * (logical.ndim - 2)), rows, 0).astype(np.float32)


class Problem:
    """Routed tokens for `num_devices` devices and E experts, logical weights of L layers."""

    def __init__(self, num_devices: int, num_experts: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        tokens = num_devices * TOKENS_PER_DEVICE
        self.x = rng.normal(size=(tokens, D)).astype(np.float32)
        self.ids = np.argsort(rng.normal(size=(tokens, num_experts)), 1)[:, :K].astype(np.int32)  # distinct
        self.weights = rng.uniform(0.1, 1.0, (tokens, K)).astype(np.float32)
        self.valid = np.ones(tokens, bool)
        self.valid[TOKENS_PER_DEVICE - 1:: 2 * TOKENS_PER_DEVICE] = False  # a padding token on every 2nd device
        self.ids[-1, 1] = -1  # a token routed to one expert only
        self.gate_up = rng.normal(0, 0.3, (LAYERS, num_experts, D, 2, F)).astype(np.float32)
        self.down = rng.normal(0, 0.3, (LAYERS, num_experts, F, D)).astype(np.float32)

    def dense(self, layer: int):
        return dense_reference(self.x, self.ids, self.weights, self.valid, self.gate_up[layer], self.down[layer])

    def routed_counts(self, num_experts: int):
        live = self.valid[:, None] & (self.ids >= 0)
        return np.bincount(self.ids[live], minlength=num_experts)


def expert_mesh(num_devices: int, model: int = 1) -> Mesh:
    devices = np.array(jax.devices()[: num_devices * model])
    if model == 1:
        return Mesh(devices, ("expert",))
    return Mesh(devices.reshape(num_devices, model), ("expert", "model"))


@functools.lru_cache(maxsize=None)
def compiled_moe(ep: ExpertParallel, path: str, model_axis: str | None = None, capacity_factor=None):
    """One jitted EP layer per (mesh, path), taking every layer's weights [L, num_slots, ...] and the layer
    (traced); weight_specs shard F over the model axis when there is one."""
    specs = None if model_axis is None else (P("expert", None, None, model_axis), P("expert", model_axis, None))
    fn = functools.partial(expert_fn, model_axis=model_axis)

    def layer_moe(x, ids, w, valid, weights, placement, layer):
        weights = tuple(leaf[layer] for leaf in weights)
        return ep.moe(x, ids, w, weights, placement, layer, valid, expert_fn=fn, path=path,
                      capacity_factor=capacity_factor, weight_specs=specs)

    return jax.jit(layer_moe)


CASES = {  # name: (expert devices, model devices, experts, redundant slots, fill)
    "1-device": (1, 1, 4, 0, "replicate"),
    "2-devices-redundant": (2, 1, 6, 2, "replicate"),
    "4-devices-uneven": (4, 1, 6, 0, "replicate"),
    "4-devices-empty-slots": (4, 1, 6, 0, "empty"),
    "8-devices-redundant": (8, 1, 12, 4, "replicate"),
    "2x2-expert-model": (2, 2, 6, 2, "replicate"),
}


@pytest.mark.parametrize("path", [ALLGATHER, ALL_TO_ALL])
@pytest.mark.parametrize("case", list(CASES))
def test_ep_equals_dense(case, path):
    num_devices, model, num_experts, redundant, fill = CASES[case]
    problem = Problem(num_devices, num_experts)
    default = Placement.default(LAYERS, num_experts, num_devices, redundant, fill=fill)
    # Layer 1 runs a rebalanced placement (hot experts replicated, replicas packed by load).
    skew = np.tile((np.arange(num_experts) + 1.0) ** 2, (LAYERS, 1))
    placement = rebalance(skew, default) if fill == "replicate" else default
    ep = ExpertParallel(expert_mesh(num_devices, model))
    moe = compiled_moe(ep, path, "model" if model > 1 else None)
    weights = (physical(problem.gate_up, placement), physical(problem.down, placement))
    for layer in range(LAYERS):
        result = moe(problem.x, problem.ids, problem.weights, problem.valid, weights, placement, layer)
        np.testing.assert_allclose(np.asarray(result.out), problem.dense(layer), atol=2e-5, rtol=2e-5)
        assert (np.asarray(result.out)[~problem.valid] == 0).all()
        assert result.load.shape == (num_devices, num_experts)
        assert (np.asarray(result.load).sum(0) == problem.routed_counts(num_experts)).all()
        assert not np.asarray(result.overflow).any()


def test_choose_replica_splits_an_expert_over_its_replicas():
    placement = Placement.from_phys_to_logical([[0, 1, 0, 2, 0, 1]], 3, 3)  # expert 0 x3, expert 1 x2
    ids = np.array([[0, 1]] * 6, np.int32)
    slots = np.asarray(choose_replica(placement, 0, ids, np.arange(6)))
    assert slots[:, 0].tolist() == [0, 2, 4, 0, 2, 4] and slots[:, 1].tolist() == [1, 5, 1, 5, 1, 5]


def test_path_choice_and_capacity():
    assert choose_path(8, 8, 4096) == ALLGATHER  # n <= k: all-gather moves no more bytes
    assert choose_path(16, 2, 8) == ALLGATHER  # few tokens: latency-bound
    assert choose_path(16, 2, 4096) == ALL_TO_ALL
    assert capacity_rows(4, 10, 2, 8) == 80 and capacity_rows(4, 10, 8, 2) == 80  # n * T_loc * min(k, G)
    assert capacity_rows(4, 10, 2, 8, capacity_factor=1.25) == 25
    with pytest.raises(ValueError, match="capacity_factor=0"):
        capacity_rows(4, 10, 2, 8, capacity_factor=0)


def test_capacity_overflow_drops_whole_contributions():
    num_devices, num_experts = 4, 8
    problem = Problem(num_devices, num_experts, seed=1)
    problem.ids[:, 0] = 0  # every token's first expert is expert 0, on device 0: it overflows
    problem.ids[:, 1] = np.where(problem.ids[:, 1] == 0, 1, problem.ids[:, 1])
    placement = Placement.default(LAYERS, num_experts, num_devices)
    weights = (physical(problem.gate_up, placement), physical(problem.down, placement))
    moe = compiled_moe(ExpertParallel(expert_mesh(num_devices)), ALL_TO_ALL, capacity_factor=1.0)
    result = moe(problem.x, problem.ids, problem.weights, problem.valid, weights, placement, 0)
    assert np.asarray(result.overflow).tolist() == [True, False, False, False]
    # Each token's output is the sum over a subset of its experts (the rows that fit); some lost one.
    out, dropped = np.asarray(result.out), 0
    for t in range(len(out)):
        subsets = []
        for keep in itertools.product([0, 1], repeat=K):
            weights_t = problem.weights[t: t + 1] * np.array(keep)
            subsets.append(dense_reference(problem.x[t: t + 1], problem.ids[t: t + 1], weights_t,
                                           problem.valid[t: t + 1], problem.gate_up[0], problem.down[0])[0])
        match = [np.allclose(out[t], s, atol=2e-5) for s in subsets]
        assert any(match), t
        dropped += not match[-1]
    assert dropped > 0


def test_emulator_follows_the_ragged_all_to_all_contract():
    # The example of jax.lax.ragged_all_to_all's docstring, on 2 devices (each row: one device's arguments).
    operand, output = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32), jnp.zeros((2, 4))
    index_args = [jnp.array(rows, jnp.int32) for rows in ([[0, 1], [0, 1]], [[1, 2], [1, 1]],  # offsets, sizes
                                                           [[0, 0], [1, 2]], [[1, 1], [2, 1]])]  # out offsets, recv
    fn = jax.shard_map(lambda *args: ragged_all_to_all_emulated(*(a[0] for a in args), axis_name="expert")[None],
                       mesh=expert_mesh(2), in_specs=P("expert"), out_specs=P("expert"))
    assert np.asarray(fn(operand, output, *index_args)).tolist() == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_placement_swap_moves_weights_and_compiles_nothing():
    num_devices, num_experts = 4, 6
    problem = Problem(num_devices, num_experts, seed=2)
    mesh = expert_mesh(num_devices)
    ep = ExpertParallel(mesh)
    first = Placement.default(LAYERS, num_experts, num_devices, num_redundant=2)
    rng = np.random.default_rng(3)
    second, third = (rebalance(rng.pareto(1.0, (LAYERS, num_experts)), first) for _ in range(2))
    assert not (second.phys_to_logical == first.phys_to_logical).all()
    assert not (third.phys_to_logical == second.phys_to_logical).all()
    sharding = NamedSharding(mesh, P(None, "expert"))

    def placed(placement):
        return tuple(jax.device_put(physical(w, placement), sharding) for w in (problem.gate_up, problem.down))

    moe = {path: compiled_moe(ep, path) for path in (ALLGATHER, ALL_TO_ALL)}

    def check(weights, placement):
        for layer, path in itertools.product(range(LAYERS), moe):
            out = moe[path](problem.x, problem.ids, problem.weights, problem.valid,
                            weights, placement, layer).out
            np.testing.assert_allclose(np.asarray(out), problem.dense(layer), atol=2e-5, rtol=2e-5)

    weights = ep.apply_placement(placed(first), first, second)  # warm-up: compiles the move and the layers
    single = jax.device_put(physical(problem.gate_up, first)[1], NamedSharding(mesh, P("expert")))
    single = ep.apply_placement(single, first, second, layer=1)  # one layer's weights
    check(weights, second)
    with jax.no_tracing():
        weights = ep.apply_placement(weights, second, third)
        for got, want in zip(weights, placed(third)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        check(weights, third)
        weights = ep.apply_placement(weights, third, first)
        check(weights, first)
        single = ep.apply_placement(single, second, third, layer=1)
        np.testing.assert_array_equal(np.asarray(single), physical(problem.gate_up, third)[1])
