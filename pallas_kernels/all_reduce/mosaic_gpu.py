"""One-shot all-reduce over peer memory for small (decode-sized) tensors: a Mosaic GPU kernel.

Why: under tensor parallelism a decode step runs two all-reduces per layer. XLA's own one-shot
all-reduce is an async fusion that its command buffers (CUDA graphs) do not capture, so each GPU's
step falls apart into ~65 graph pieces, each updated and launched from the host (~80-90 us each,
benchmarks/RESULTS.md): the host, not the GPU, sets the pace. This kernel is a plain custom call
with no host-side work per execution, so the whole step stays one graph per GPU.

Data flow of one call on device `r` of N (grid = n / CHUNK blocks of one warpgroup; block b owns
elements [b * CHUNK, (b + 1) * CHUNK) of the flattened input):

    epoch = ++counter[b]            (per-block call counter in r's own workspace; every device runs
                                     the same sequence of calls, so epochs agree across devices)
    p = epoch & 1                   (double-buffered slots: a fast peer may start call e + 1 while
                                     we still read call e's slot)
    for every device j:  ws_j.data[p][r][chunk b] = x[chunk b]    (NVLink stores, own slot too)
    fence; barrier; one thread: for every j, ws_j.flag[p][b][r] = epoch (release, system scope)
    one thread waits until ws_r.flag[p][b][j] == epoch for every j (acquire)
    y[chunk b] = sum over j = 0..N-1 of ws_r.data[p][j][chunk b]   (f32, fixed order: every device
                                                                    computes bit-identical sums)

Slot p of block b is safe to overwrite at call e + 2: finishing call e + 1 needed every peer's call
e + 1 data, which a peer writes only after its call e kernel (and so its reads of slot p) is done.

The workspace is one persistent device buffer per device, allocated once (`Workspace`); the kernel
reaches its own and its peers' workspaces through raw device pointers held in a small int32 table
(lo/hi words), one row per device. This needs CUDA peer access between the devices (XLA enables
it between the local GPUs of one process) and one process driving all of them.

Scope: bf16/f16/f32, n a multiple of CHUNK and at most `Workspace.max_elems`; larger tensors
should take `lax.psum` (prefill is not latency bound). Calls that share a workspace must run in one
order on every device, one after the other: data dependencies order them in a transformer's
residual stream; two independent all-reduces in one program could run concurrently in a CUDA graph.
Needs sm_90+ (Mosaic GPU) and GPUs with peer access and peer atomics (NVLink). No interpret mode: Mosaic's interpreter
does not model peer memory, so the kernel is tested on the GPU tier only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 4096  # elements per block: 128 threads x 4 vectors of 8 x 16-bit
THREADS = 128
_COUNTER_BYTES = 4
_FLAG_BYTES = 4
_ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte offsets inside one device's workspace."""
    num_devices: int
    max_elems: int  # largest all-reduce (elements) the workspace holds
    itemsize: int = 4  # slots are sized for the widest dtype (f32)

    @property
    def max_blocks(self) -> int:
        return self.max_elems // CHUNK

    @property
    def flags_offset(self) -> int:
        return _round_up(self.max_blocks * _COUNTER_BYTES, _ALIGN)

    def flag_offset(self, parity, block, src):
        return self.flags_offset + ((parity * self.max_blocks + block) * self.num_devices + src) * _FLAG_BYTES

    @property
    def data_offset(self) -> int:
        return _round_up(self.flags_offset + 2 * self.max_blocks * self.num_devices * _FLAG_BYTES, _ALIGN)

    def slot_offset(self, parity, src):
        return self.data_offset + (parity * self.num_devices + src) * self.max_elems * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.data_offset + 2 * self.num_devices * self.max_elems * self.itemsize


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Workspace:
    """Persistent peer-visible buffers for one group of devices (one tensor-parallel group).

    Holds one zeroed byte buffer per device and the pointer table the kernel reads: a jax array
    [N, 2 + 2N] int32 sharded one row per device (row r: rank r, then every device's workspace
    address as lo/hi words). Keep the Workspace alive as long as any compiled step may run.
    """

    def __init__(self, devices, max_elems: int = 64 * 8192):
        self.devices = list(devices)
        if max_elems % CHUNK:
            raise ValueError(f"max_elems must be a multiple of {CHUNK}, got {max_elems}")
        self.layout = Layout(len(self.devices), max_elems)
        self.buffers = [jax.device_put(np.zeros(self.layout.nbytes, np.uint8), d) for d in self.devices]
        addrs = [b.unsafe_buffer_pointer() for b in self.buffers]
        n = len(self.devices)
        rows = np.zeros((n, 2 + 2 * n), np.uint32)
        for r in range(n):
            rows[r, 0] = r
            for j, a in enumerate(addrs):
                rows[r, 2 + 2 * j] = a & 0xFFFFFFFF
                rows[r, 3 + 2 * j] = a >> 32
        self.rows = rows.view(np.int32)

    def table(self, mesh, axis: str) -> jax.Array:
        """The pointer table as an array sharded over `axis` of `mesh` (one row per device)."""
        from jax.sharding import NamedSharding, PartitionSpec
        sharding = NamedSharding(mesh, PartitionSpec(axis, None))
        order = [self.devices.index(d) for d in mesh.devices.reshape(-1)]
        if order != list(range(len(self.devices))):
            raise ValueError("the mesh axis must list the workspace's devices in the same order")
        return jax.make_array_from_callback(self.rows.shape, sharding, lambda idx: self.rows[idx])


@dataclasses.dataclass(frozen=True)
class OneShotAllReduce:
    """The kernel as a static, hashable all-reduce for sharding.TensorParallel.all_reduce."""
    layout: Layout

    def fits(self, x) -> bool:
        """Float tensors of whole chunks that fit the workspace (decode-sized); larger ones take psum."""
        return (jnp.issubdtype(x.dtype, jnp.floating) and x.size % CHUNK == 0
                and 0 < x.size <= self.layout.max_elems and x.dtype.itemsize <= self.layout.itemsize)

    def __call__(self, x: jax.Array, table_row: jax.Array) -> jax.Array:
        return all_reduce(x, table_row, self.layout)


def all_reduce(x: jax.Array, table_row: jax.Array, layout: Layout) -> jax.Array:
    """Inside shard_map: sum `x` over the devices of the workspace; `table_row` is this device's
    [1, 2 + 2N] (or [2 + 2N]) row of `Workspace.table`. Returns x's shape and dtype."""
    n = x.size
    if n % CHUNK or n > layout.max_elems:
        raise ValueError(f"all_reduce: {n} elements; need a multiple of {CHUNK} and at most "
                         f"{layout.max_elems} (use lax.psum for larger tensors)")
    if x.dtype.itemsize > layout.itemsize:
        raise ValueError(f"all_reduce: dtype {x.dtype} is wider than the workspace slots")
    kernel = _kernel(n, jnp.dtype(x.dtype), layout)
    y = kernel(x.reshape(n), table_row.reshape(-1))
    return y.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _kernel(n: int, dtype: jnp.dtype, layout: Layout):
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, scf
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils

    num_devices = layout.num_devices
    itemsize = dtype.itemsize
    vec = 16 // itemsize
    if CHUNK % (THREADS * vec):
        raise ValueError(f"CHUNK {CHUNK} is not a multiple of {THREADS * vec}")

    def body(ctx, x_ref, table_ref, y_ref, _smem):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()
        f32 = ir.F32Type.get()
        ptr_ty = llvm.PointerType.get()
        elem_ty = y_ref.type.element_type
        chunk_ty = ir.MemRefType.get((CHUNK,), elem_ty)

        def c64(v):
            return arith.constant(i64, v)

        def word(k):  # table entry k as an unsigned i64
            return arith.extui(i64, memref.load(table_ref, [arith.constant(index, k)]))

        def address(j):  # device j's workspace base address
            return arith.ori(word(2 + 2 * j), arith.shli(word(3 + 2 * j), c64(32)))

        def as_ptr(addr):
            return llvm.inttoptr(ptr_ty, addr)

        rank = word(0)
        bases = [address(j) for j in range(num_devices)]
        own = bases[0]
        for j in range(1, num_devices):  # own = bases[rank]
            own = arith.select(arith.cmpi(arith.CmpIPredicate.eq, rank, c64(j)), bases[j], own)

        block = arith.extui(i64, arith.index_cast(i32, gpu.block_id(gpu.Dimension.x)))
        counter = as_ptr(arith.addi(own, arith.muli(block, c64(_COUNTER_BYTES))))
        epoch = arith.addi(utils.inline_ptx("ld.relaxed.gpu.global.u32 $0, [$1];", counter,
                                            result_types=i32, has_side_effects=True),
                           arith.constant(i32, 1))
        parity = arith.extui(i64, arith.andi(epoch, arith.constant(i32, 1)))
        chunk_bytes = arith.muli(block, c64(CHUNK * layout.itemsize))  # a block's bytes: the same for every dtype
        slot_bytes = c64(layout.max_elems * layout.itemsize)

        def slot(base, src):  # [CHUNK] memref: block's chunk of slot (parity, src) in a workspace
            k = arith.addi(arith.muli(parity, c64(num_devices)), src)
            addr = arith.addi(arith.addi(base, c64(layout.data_offset)), arith.muli(k, slot_bytes))
            return utils.ptr_as_memref(as_ptr(arith.addi(addr, chunk_bytes)), chunk_ty)

        def flag(base, src):
            k = arith.addi(arith.muli(arith.addi(arith.muli(parity, c64(layout.max_blocks)), block),
                                      c64(num_devices)), src)
            return as_ptr(arith.addi(arith.addi(base, c64(layout.flags_offset)), arith.muli(k, c64(_FLAG_BYTES))))

        start = arith.index_cast(index, arith.muli(block, c64(CHUNK)))
        x = mgpu.FragmentedArray.load_strided(utils.memref_slice(x_ref, utils.ds(start, CHUNK)), vec_size=vec)
        for j in range(num_devices):
            x.store_untiled(slot(bases[j], rank))
        utils.inline_ptx("fence.acq_rel.sys;", has_side_effects=True)
        utils.warpgroup_barrier()
        with utils.single_thread():  # one thread publishes the block's epoch into every device's flag
            for j in range(num_devices):
                utils.inline_ptx("st.release.sys.global.u32 [$0], $1;", flag(bases[j], rank), epoch,
                                 has_side_effects=True)
            # A peer's flag (p, b, j) holds epoch - 2 until it wrote this call's data (it cannot be a
            # call ahead: that needs ours): wait for equality, which survives the u32 wrap-around.
            for j in range(num_devices):
                loop = scf.WhileOp([], [])
                with ir.InsertionPoint(loop.before.blocks.append()):
                    seen = utils.inline_ptx("ld.acquire.sys.global.u32 $0, [$1];", flag(own, c64(j)),
                                            result_types=i32, has_side_effects=True)
                    scf.condition(arith.cmpi(arith.CmpIPredicate.ne, seen, epoch), [])
                with ir.InsertionPoint(loop.after.blocks.append()):
                    scf.yield_([])
        utils.warpgroup_barrier()
        utils.inline_ptx("fence.acq_rel.sys;", has_side_effects=True)
        total = None
        for j in range(num_devices):
            part = mgpu.FragmentedArray.load_strided(slot(own, c64(j)), vec_size=vec).astype(f32)
            total = part if total is None else total + part
        total.astype(elem_ty).store_untiled(utils.memref_slice(y_ref, utils.ds(start, CHUNK)))
        utils.warpgroup_barrier()
        with utils.single_thread():
            utils.inline_ptx("st.relaxed.gpu.global.u32 [$0], $1;", counter, epoch, has_side_effects=True)

    x_shape = jax.ShapeDtypeStruct((n,), dtype)
    table_shape = jax.ShapeDtypeStruct((2 + 2 * num_devices,), jnp.int32)
    with mlir.make_ir_context(), ir.Location.unknown():
        return mgpu.as_gpu_kernel(body, grid=(n // CHUNK, 1, 1), block=(THREADS, 1, 1),
                                  in_shape=(x_shape, table_shape), out_shape=x_shape, smem_scratch_shape=(),
                                  module_name="one_shot_all_reduce", kernel_name="one_shot_all_reduce")
