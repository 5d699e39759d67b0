"""Grouped GEMM over ragged row groups, for MoE experts (rows sorted by expert).

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G] int32) -> [M, N] in lhs.dtype

Row r of group g (groups in order, group g owning group_sizes[g] consecutive rows) gets
lhs[r] @ rhs[g]; rows past sum(group_sizes) are zero, as `jax.lax.ragged_dot` gives them.

backend:
  * "reference": `jax.lax.ragged_dot`;
  * "pallas": the Mosaic GPU kernel (`gpu.py`, Hopper, bf16/f16) or the TPU kernel (`tpu.py`),
    chosen by `platform` (default: JAX's default backend; on a CPU host the TPU kernel, which then
    needs `interpret`);
  * "auto": "pallas" where its kernel takes the call (Hopper with bf16/f16 operands and K, N
    dividing its tiles; TPU), else "reference".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm import gpu, reference, tpu

BACKENDS = ("auto", "reference", "pallas")


def _platform(platform: str | None) -> str:
    platform = platform or jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def _gpu_takes(lhs, rhs) -> bool:
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    kind = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "H200"
    if not any(name in kind for name in ("H100", "H200", "H800", "GH200")):
        return False
    cfg = gpu.default_config(lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0])
    return lhs.shape[1] % cfg.block_k == 0 and rhs.shape[2] % cfg.block_n == 0


def grouped_matmul(lhs, rhs, group_sizes, *, backend: str = "auto", interpret=False,
                   platform: str | None = None, config=None):
    """See the module doc. `interpret` runs the Pallas kernel in interpret mode (GPU: True selects
    the Mosaic GPU simulator; TPU: True or a `pltpu.InterpretParams`). `config`: a `gpu.GpuConfig`
    or `tpu.TpuConfig` for the chosen kernel (default: chosen from the shapes)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}: expected "
                         "lhs [M, K], rhs [G, K, N] and group_sizes [G]")
    plat = _platform(platform)
    if plat == "cpu" and interpret:
        plat = "tpu"
    if backend == "auto":
        takes = (plat == "gpu" and _gpu_takes(lhs, rhs)) or plat == "tpu"
        backend = "pallas" if takes else "reference"
    if backend == "reference":
        return reference.ragged_dot(lhs, rhs, group_sizes)
    if plat == "gpu":
        return gpu.grouped_matmul(lhs, rhs, group_sizes, config, interpret=bool(interpret))
    if plat == "tpu":
        return tpu.grouped_matmul(lhs, rhs, group_sizes, config, interpret=interpret)
    raise ValueError(f"backend='pallas' on platform {plat!r}: the Pallas grouped GEMM runs on a GPU or "
                     "TPU, or on a CPU with interpret=True; use backend='reference' here")
