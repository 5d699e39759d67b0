"""Reference grouped GEMMs: XLA's `lax.ragged_dot` (the portable path) and a pure-jnp ground truth."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_dot(lhs, rhs, group_sizes):
    """XLA's grouped GEMM: lhs [M, K], rhs [G, K, N], group_sizes [G] -> [M, N] in lhs.dtype; rows past
    sum(group_sizes) are zero."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


def row_groups(group_sizes, m: int):
    """The group of each of the m rows; G for the rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.sum(jnp.arange(m, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1)


def grouped_matmul_f32(lhs, rhs, group_sizes):
    """Ground truth in float32 at full precision, one product per row (tests and tiny shapes only)."""
    g = rhs.shape[0]
    groups = row_groups(group_sizes, lhs.shape[0])
    w = jnp.take(rhs.astype(jnp.float32), jnp.minimum(groups, g - 1), axis=0)  # [M, K, N]
    out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return jnp.where((groups < g)[:, None], out, 0.0)
