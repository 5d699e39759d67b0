"""`jax.lax.ragged_all_to_all` where XLA has it (GPU, TPU), and an emulator with the same contract for CPU.

Contract (per device, inside shard_map over `axis_name` of n devices; index arrays int32 [n]):
    operand [N, ...]     rows to send, the rows for peer j at input_offsets[j] .. + send_sizes[j]
    output  [M, ...]     static receive buffer; rows nobody writes keep their value
    output_offsets[j]    where my rows land in PEER j's output (peer j computed it and sent it back)
    recv_sizes[j]        rows I get from peer j (= all_to_all(send_sizes)[j])
There is no bounds check: callers keep output_offsets[j] + send_sizes[j] <= M on the receiving side.

The emulator sends every peer a full N-row window (n * N rows per device instead of the ragged sizes)
and scatters the received rows into place: correct, and only meant for CPU tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name: str, platform: str | None = None):
    """XLA's ragged all-to-all, or the emulator on CPU (XLA:CPU has no ragged-all-to-all).
    platform: the platform of the mesh's devices; default jax.default_backend()."""
    platform = platform or jax.default_backend()
    impl = ragged_all_to_all_emulated if platform == "cpu" else lax.ragged_all_to_all
    return impl(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name: str):
    """The contract above from all_to_all + scatter."""
    rows = operand.shape[0]
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])  # any window [offset, offset + N) is in bounds
    index = jnp.arange(rows)

    def window(offset, size):  # [N, ...]: my rows for one peer, zeros past its size
        chunk = lax.dynamic_slice_in_dim(padded, offset, rows)
        return jnp.where((index < size).reshape(-1, *[1] * (operand.ndim - 1)), chunk, 0)

    windows = jax.vmap(window)(input_offsets, send_sizes)  # [n, N, ...], row j for peer j
    received = lax.all_to_all(windows, axis_name, 0, 0, tiled=True)  # row j: what peer j sent me
    starts = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where peer j's rows go in my output
    target = jnp.where(index[None, :] < recv_sizes[:, None], starts[:, None] + index[None, :], output.shape[0])
    return output.at[target.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")
