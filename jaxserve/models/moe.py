"""Mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE): router, dispatch, grouped expert
GEMMs, combine. Numerics follow Hugging Face transformers for each family.

    x [T, D] --route--> weights [T, k], ids [T, k]   (router logits in the model dtype, softmax in
                                                      float32 over all E experts, top-k, renormalised
                                                      if the family does, weights in its dtype)
      --dispatch--> x_sorted [T*k, D] (token copies sorted by expert, stable), group_sizes [E]
      --experts_ffn--> y_sorted [T*k, D]   (one ragged GEMM for gate|up, SiLU(gate) * up, one for down)
      --combine--> out [T, D]              (unsorted, weighted sum over the k copies)
      (+ sigmoid(x @ shared_gate) * shared SwiGLU MLP (x), Qwen2-MoE)

The stages are separate functions so a kernel can replace `experts_ffn` (the grouped GEMMs) and
expert parallelism can move rows between devices between `dispatch` and `experts_ffn` and back
before `combine`. Every one of the T*k token copies belongs to a group (sum(group_sizes) == T*k),
including the padding rows of a bucketed step: they are routed like any token, and their outputs
are discarded with the rest of those rows by the caller.

Tensor parallelism (inside the model's shard_map): the router and the shared-expert gate are
replicated; each expert's F axis is sharded like the dense MLP's (gate/up column-parallel, down
row-parallel), so the block returns this device's partial sum and the caller's psum completes it.
Everything after the down projection is linear in it (per-row weights, unsort, sum), so the sum of
the partials is the block's output.

Expert parallelism (llama.py passes `routed`): the router runs on each device's own tokens, and
sharding/expert_parallel moves the routed rows to the devices holding their experts' slots, runs
`slot_ffn` there and brings the results back; still linear in the down projection, so the partial
sums over "model" work the same.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.models import layers
from pallas_kernels.grouped_gemm import grouped_matmul


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The MoE part of a model config (hashable: it is part of the static model config)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # F of each routed expert
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is this block; the others are dense
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to one
    # Mixtral keeps the routing weights in float32 and casts each weighted expert output to the model
    # dtype; Qwen2/3-MoE cast the weights to the model dtype first.
    float32_weights: bool = False
    shared_intermediate_size: int = 0  # F of the always-on shared expert (Qwen2-MoE); 0: none

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts "
                             f"({self.num_experts})")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.intermediate_size}")


# Logical axes of the block's parameters: E is "experts" in the expert weights (expert parallelism shards
# it, stored by physical slot) and "expert_logits" in the router (whole and logical everywhere); the routed
# experts' F is "expert_mlp", the shared expert's "shared_mlp". The fused gate|up weight keeps gate and up
# on their own axis of 2 so sharding F splits both alike.
AXES: dict[str, tuple[str | None, ...]] = {
    "router": ("embed", "expert_logits"),
    "we_gate_up": ("experts", "embed", None, "expert_mlp"), "we_down": ("experts", "expert_mlp", "embed"),
    "ws_gate": ("embed", "shared_mlp"), "ws_up": ("embed", "shared_mlp"), "ws_down": ("shared_mlp", "embed"),
    "shared_gate": ("embed",),
}


def abstract(spec: MoeSpec, hidden_size: int, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of one MoE layer's MLP parameters (replacing the dense layer's w_gate, w_up, w_down)."""
    sizes = {"embed": hidden_size, "experts": spec.num_experts, "expert_logits": spec.num_experts, None: 2, "expert_mlp": spec.intermediate_size,
             "shared_mlp": spec.shared_intermediate_size}
    names = ["router", "we_gate_up", "we_down"]
    if spec.shared_intermediate_size:
        names += ["ws_gate", "ws_up", "ws_down", "shared_gate"]
    return {name: jax.ShapeDtypeStruct(tuple(sizes[a] for a in AXES[name]), dtype) for name in names}


def route(x: jax.Array, router: jax.Array, spec: MoeSpec) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router [D, E] -> (weights [T, k], expert ids [T, k] int32), best expert first.

    The logits are computed in x's dtype and then taken to float32, as HF does; the weights are
    float32 (Mixtral) or x's dtype (Qwen)."""
    logits = jnp.einsum("td,de->te", x, router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, spec.top_k)
    if spec.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if not spec.float32_weights:
        weights = weights.astype(x.dtype)
    return weights, ids.astype(jnp.int32)


def dispatch(x: jax.Array, ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token copies grouped by expert: (x_sorted [T*k, D], group_sizes [E] int32, order [T*k]).

    Copy j of the flattened [T*k] ids is row order[j] // k of x; the sort is stable, so within an
    expert the copies stay in token order."""
    k = ids.shape[-1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return x[order // k], group_sizes, order


def experts_ffn(x_sorted: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *,
                backend: str = "auto", interpret: bool = False) -> jax.Array:
    """The SwiGLU FFN of every expert on its group of rows: x_sorted [M, D] (rows of expert e after
    those of experts < e), group_sizes [E], w_gate_up [E, D, 2, F], w_down [E, F, D] -> [M, D].

    Both projections are grouped GEMMs (pallas_kernels/grouped_gemm: the Pallas kernel where it takes the
    shapes, on Hopper and TPU, else lax.ragged_dot; `backend`/`interpret` as grouped_matmul's). Rows past
    sum(group_sizes) come out as zeros."""
    num_experts, width, _, ffn = w_gate_up.shape
    gate_up = grouped_matmul(x_sorted, w_gate_up.reshape(num_experts, width, 2 * ffn), group_sizes,
                             backend=backend, interpret=interpret)
    hidden = jax.nn.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
    return grouped_matmul(hidden, w_down, group_sizes, backend=backend, interpret=interpret)


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Undo `dispatch`'s sort and sum each token's k expert outputs: y_sorted [T*k, D], weights [T, k]
    -> [T, D] in `dtype`. Each weighted output is cast to `dtype` before the sum, as HF does."""
    tokens, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y_sorted[inverse].reshape(tokens, k, -1)
    return jnp.sum((y * weights[..., None]).astype(dtype), axis=1)


def slot_ffn(x_rows: jax.Array, group_sizes: jax.Array, expert_weights: tuple[jax.Array, jax.Array]) -> jax.Array:
    """experts_ffn over one device's expert slots, in sharding/expert_parallel's `expert_fn` form:
    expert_weights = (we_gate_up [G, D, 2, F], we_down [G, F, D])."""
    return experts_ffn(x_rows, group_sizes, *expert_weights)


def moe_mlp(lp: dict[str, jax.Array], x: jax.Array, spec: MoeSpec, routed: Callable | None = None) -> jax.Array:
    """The whole block on the normed hidden states x [T, D] -> [T, D] (a partial sum under tensor
    parallelism: see the module docstring). `routed(x, weights, ids, lp) -> [T, D]` replaces dispatch,
    experts_ffn and combine (expert parallelism: the experts live on other devices)."""
    weights, ids = route(x, lp["router"], spec)
    if routed is not None:
        out = routed(x, weights, ids, lp)
    else:
        x_sorted, group_sizes, order = dispatch(x, ids, spec.num_experts)
        y_sorted = experts_ffn(x_sorted, group_sizes, lp["we_gate_up"], lp["we_down"])
        out = combine(y_sorted, order, weights, x.dtype)
    if spec.shared_intermediate_size:
        shared = layers.gated_mlp(x, lp["ws_gate"], lp["ws_up"], lp["ws_down"])
        out = out + jax.nn.sigmoid(x @ lp["shared_gate"])[:, None] * shared
    return out
