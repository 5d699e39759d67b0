"""Does XLA launch Mosaic GPU kernels with programmatic dependent launch (PDL)?

    XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" python3 benchmarks/pdl_probe.py

Two one-block kernels in one jitted program, B reading A's output. A lets its dependents launch
(`griddepcontrol.launch_dependents`) and then spins for 20 us; B reads the clock at its first
instruction, waits for A (`griddepcontrol.wait`) and reads it again. With PDL, B starts while A still
spins (B's start < A's end), so a kernel could load the weights it does not need A for before A ends;
without, B starts after A ends. Prints the three offsets from A's start, in us.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SPIN_NS = 20_000


@functools.lru_cache(maxsize=None)
def _kernel(kind: str):
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, memref
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils

    def body(ctx, x_ref, out_ref, _):
        del ctx, x_ref
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()

        def now():
            return utils.inline_ptx("mov.u64 $0, %globaltimer;", result_types=i64, has_side_effects=True)

        def store(k, t):  # out[2k], out[2k + 1] = low, high word of t
            memref.store(arith.trunci(i32, t), out_ref, [arith.constant(index, 2 * k)])
            memref.store(arith.trunci(i32, arith.shrui(t, arith.constant(i64, 32))), out_ref,
                         [arith.constant(index, 2 * k + 1)])

        first = arith.cmpi(arith.CmpIPredicate.eq, gpu.thread_id(gpu.Dimension.x), arith.constant(index, 0))
        start = now()
        if kind == "A":
            utils.inline_ptx("griddepcontrol.launch_dependents;", has_side_effects=True)
            utils.inline_ptx("\n".join([
                "{", ".reg .u64 t;", ".reg .pred p;", "PDL_SPIN:", "mov.u64 t, %globaltimer;",
                "sub.u64 t, t, $0;", f"setp.lt.u64 p, t, {SPIN_NS};", "@p bra PDL_SPIN;", "}"]),
                start, has_side_effects=True)
        else:
            utils.inline_ptx("griddepcontrol.wait;", has_side_effects=True)
        end = now()
        with utils.when(first):
            store(0, start)
            store(1, end)

    spec = jax.ShapeDtypeStruct((4,), jnp.int32)
    with mlir.make_ir_context(), ir.Location.unknown():
        return mgpu.as_gpu_kernel(body, grid=(1, 1, 1), block=(128, 1, 1), in_shape=(spec,), out_shape=spec,
                                  smem_scratch_shape=(), module_name=f"pdl_{kind}", kernel_name=f"pdl_{kind}")


def main() -> None:
    step = jax.jit(lambda x: (lambda a: (a, _kernel("B")(a)))(_kernel("A")(x)))
    x = jnp.zeros((4,), jnp.int32)
    for _ in range(3):
        a, b = jax.block_until_ready(step(x))
    a, b = (np.asarray(v).view(np.uint32).astype(np.int64) for v in (a, b))
    t = lambda v, k: int(v[2 * k]) | (int(v[2 * k + 1]) << 32)
    a0 = t(a, 0)
    print(f"A ends {(t(a, 1) - a0) / 1e3:.1f} us, B starts {(t(b, 0) - a0) / 1e3:.1f} us, "
          f"B passes its wait {(t(b, 1) - a0) / 1e3:.1f} us after A's start")
    print("PDL: B started while A ran" if t(b, 0) < t(a, 1) else "no PDL: B started after A ended")


if __name__ == "__main__":
    main()
