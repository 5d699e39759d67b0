"""One-shot all-reduce over peer memory for small (decode-sized) tensors, optionally fused with the
residual add and RMSNorm that follow it in a transformer layer: Mosaic GPU kernels.

Why: under tensor parallelism a decode step runs two all-reduces per layer. XLA's own one-shot
all-reduce is an async fusion that its command buffers (CUDA graphs) do not capture, so each GPU's
step falls apart into dozens of graph pieces, each updated and launched from the host
(benchmarks/RESULTS.md): the host, not the GPU, sets the pace. These kernels are plain custom calls
with no host-side work per execution, so the whole step stays one graph per GPU. At batch 1 an
all-reduce is pure latency, so the protocol has no flags and no fences (the "Lamport" scheme):

    every slot of the workspace holds the dtype's -0.0 ("empty") until data arrives; data never
    holds -0.0 (inputs' -0.0 are sent as +0.0; sums are unchanged).
    epoch = counter[region] + 1, p = epoch & 1     (one counter per region of THREADS vectors in the
                                                     device's own workspace; every device runs the same
                                                     sequence of calls, so epochs agree everywhere)
    for every peer j:  ws_j.data[p][r][v] = x[v]    (one 16-byte NVLink store per thread and peer)
    for every peer j:  spin on ws_r.data[p][j][v] until none of its elements is -0.0
    y[v] = sum over j = 0..N-1 in that order, in f32 (own x for j = r): bit-identical on all devices
                                                    (and to XLA's psum at N = 2; for N > 2 XLA may round
                                                    between partial sums, this kernel rounds once)
    ws_r.data[p][j][v] = -0.0 again; counter[region] = epoch (after a block barrier)

One NVLink hop per call instead of a store, a fence round trip and a flag. Slot p is written again
at call e + 2; a peer gets there only after reading our call e + 1 data, which we send after call e's
kernel (and its reset of slot p) finished. Reads poll 16-byte vectors element by element, so a vector
that lands in pieces is never taken half-written.

`all_reduce_rms_norm` fuses `x = residual + all_reduce(partial); h = rms_norm(x) * weight` (one CUDA
block per row, the row's sum of squares reduced in the block) with the rounding steps of the unfused
XLA ops: the sum and the residual add are rounded to the dtype, the norm's statistics are f32.

The workspace is one persistent device buffer per device and dtype, allocated once (`Workspace`; a
buffer's "empty" marker is its dtype's -0.0); the kernels reach their own and their peers' buffers
through raw device pointers held in a small int32 table (lo/hi words), one row per device. An
all-gather of a small tensor runs as an all-reduce of zeros around each device's slice (exact), so
a decode step's logits gather stays in the step's graph too (`OneShotAllReduce.gather_size`). This needs
CUDA peer access between the devices (XLA enables it between the local GPUs of one process) and one
process driving all of them.

Scope: bf16/f32, n a multiple of `Layout.chunk` (THREADS vectors of 16 bytes) and at most
`Layout.max_elems`; larger tensors should take `lax.psum` (prefill is not latency bound). Calls that
share a workspace must run in one order on every device, one after the other: data dependencies order
them in a transformer's residual stream; two independent all-reduces in one program could run
concurrently in a CUDA graph. Needs sm_90+ (Mosaic GPU) and GPUs with peer access (NVLink). No
interpret mode: Mosaic's interpreter does not model peer memory, so the kernels are tested on the GPU
tier only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

THREADS = 128  # threads per region: each moves one 16-byte vector of a call
VECTOR_BYTES = 16
MAX_BLOCK_THREADS = 1024
_COUNTER_BYTES = 4
_ALIGN = 256
_EMPTY = {2: 0x8000, 4: 0x80000000}  # -0.0 in 16- and 32-bit floats
_DTYPES = ("bfloat16", "float32")
_labels = itertools.count()  # unique PTX labels per inline-asm spin loop


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte offsets inside one device's workspace: a u32 counter per region, then two buffers of N
    slots of max_elems elements (slot [p][src] receives device src's data in calls of parity p)."""
    num_devices: int
    max_elems: int  # largest all-reduce (elements) the workspace holds
    dtype: str = "bfloat16"  # the one dtype the buffer carries
    table_index: int = 0  # which of the pointer table's address sets is this buffer's (one per dtype)

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"all-reduce workspace dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_elems % self.chunk:
            raise ValueError(f"max_elems must be a multiple of {self.chunk}, got {self.max_elems}")

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def chunk(self) -> int:
        """Elements per region: a CUDA block of the plain all-reduce, a tensor's size granule."""
        return THREADS * VECTOR_BYTES // self.itemsize

    @property
    def max_regions(self) -> int:
        return self.max_elems // self.chunk

    @property
    def data_offset(self) -> int:
        return _round_up(self.max_regions * _COUNTER_BYTES, _ALIGN)

    @property
    def slot_bytes(self) -> int:
        return self.max_elems * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.data_offset + 2 * self.num_devices * self.slot_bytes


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Workspace:
    """Persistent peer-visible buffers for one group of devices (one tensor-parallel group): per device
    one byte buffer per dtype (counters zero, slots "empty"), and the pointer table the kernels read.

    `dtypes`: {dtype: max_elems}, e.g. the model's activations (decode-sized all-reduces) and float32
    (the logits' all-gather). The table is a jax array [N, 2 + 2 N D] int32 sharded one row per device
    (row r: rank r, then for each dtype every device's buffer address as lo/hi words). Keep the
    Workspace alive as long as any compiled step may run.
    """

    def __init__(self, devices, dtypes=None, max_elems: int = 64 * 8192):
        self.devices = list(devices)
        n = len(self.devices)
        if not isinstance(dtypes, dict):  # one dtype
            dtypes = {jnp.dtype(dtypes or "bfloat16").name: max_elems}
        self.layouts = {}
        self.buffers = []
        rows = np.zeros((n, 2 + 2 * n * len(dtypes)), np.uint32)
        rows[:, 0] = np.arange(n)
        for k, (dtype, elems) in enumerate(dtypes.items()):
            layout = Layout(n, elems, jnp.dtype(dtype).name, k)
            init = np.zeros(layout.nbytes, np.uint8)
            init[layout.data_offset:].view(np.uint16 if layout.itemsize == 2 else np.uint32)[:] = \
                _EMPTY[layout.itemsize]
            buffers = [jax.device_put(init, d) for d in self.devices]
            for j, b in enumerate(buffers):
                a = b.unsafe_buffer_pointer()
                rows[:, 2 + 2 * (k * n + j)] = a & 0xFFFFFFFF
                rows[:, 3 + 2 * (k * n + j)] = a >> 32
            self.layouts[layout.dtype] = layout
            self.buffers += buffers
        self.layout = next(iter(self.layouts.values()))  # the first dtype's
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
    """The kernels as a static, hashable all-reduce for sharding.TensorParallel.all_reduce, over the
    buffers of one Workspace (`OneShotAllReduce.of(workspace)`)."""
    layouts: tuple[Layout, ...]

    @classmethod
    def of(cls, workspace: Workspace) -> OneShotAllReduce:
        return cls(tuple(workspace.layouts.values()))

    def layout(self, x) -> Layout | None:
        return next((l for l in self.layouts if jnp.dtype(l.dtype) == jnp.dtype(x.dtype)), None)

    def fits(self, x) -> bool:
        """Tensors of a dtype the workspace carries, whole chunks, that fit it (decode-sized); others
        take XLA's collectives."""
        layout = self.layout(x)
        return layout is not None and x.size % layout.chunk == 0 and 0 < x.size <= layout.max_elems

    def fits_rms_norm(self, x) -> bool:
        """Also fused with the residual add and RMSNorm: rows of whole chunks, one CUDA block per row."""
        width = x.shape[-1]
        return (self.fits(x) and width % self.layout(x).chunk == 0
                and width * x.dtype.itemsize // VECTOR_BYTES <= MAX_BLOCK_THREADS)

    def __call__(self, x: jax.Array, table_row: jax.Array) -> jax.Array:
        return all_reduce(x, table_row, self.layout(x))

    def add_rms_norm(self, partial, residual, weight, eps: float, table_row):
        return all_reduce_rms_norm(partial, residual, weight, eps, table_row, self.layout(partial))

    def gather_size(self, x, num_shards: int, axis: int) -> int | None:
        """The padded width of `x`'s all-gather along its last axis run as an all-reduce (each device
        adds its slice into zeros: exact), or None when that does not fit the workspace."""
        if axis not in (-1, x.ndim - 1):
            return None
        layout = self.layout(x)
        if layout is None:
            return None
        rows = x.size // x.shape[-1]
        width = x.shape[-1] * num_shards
        per_chunk = layout.chunk // math.gcd(layout.chunk, rows)  # width multiple making rows x width whole chunks
        width = -(-width // per_chunk) * per_chunk
        return width if rows * width <= layout.max_elems else None


def _check(x: jax.Array, layout: Layout) -> None:
    if x.size % layout.chunk or x.size > layout.max_elems:
        raise ValueError(f"all_reduce: {x.size} elements; need a multiple of {layout.chunk} and at most "
                         f"{layout.max_elems} (use lax.psum for larger tensors)")
    if jnp.dtype(x.dtype) != jnp.dtype(layout.dtype):
        raise ValueError(f"all_reduce: dtype {x.dtype}, but the workspace carries {layout.dtype}")


def all_reduce(x: jax.Array, table_row: jax.Array, layout: Layout) -> jax.Array:
    """Inside shard_map: sum `x` over the devices of the workspace; `table_row` is this device's row
    of `Workspace.table` ([1, W] or [W]); `layout` the workspace's buffer for x's dtype. Returns x's
    shape and dtype."""
    _check(x, layout)
    kernel = _kernel(x.size, layout, layout.chunk, None, table_row.size)
    return kernel(x.reshape(-1), table_row.reshape(-1)).reshape(x.shape)


def all_reduce_rms_norm(partial: jax.Array, residual: jax.Array, weight: jax.Array, eps: float,
                        table_row: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map, for [..., D] partial sums and residual: x = residual + all_reduce(partial),
    then (rms_norm(x) * weight, x), as the unfused ops round them. D * itemsize / 16 must be a multiple
    of THREADS and at most 1024 (one CUDA block per row)."""
    _check(partial, layout)
    width = partial.shape[-1]
    if residual.shape != partial.shape or weight.shape != (width,) or width % layout.chunk \
            or width * layout.itemsize // VECTOR_BYTES > MAX_BLOCK_THREADS:
        raise ValueError(f"all_reduce_rms_norm: partial {partial.shape}, residual {residual.shape}, weight "
                         f"{weight.shape}; rows must be whole chunks of {layout.chunk} and at most "
                         f"{MAX_BLOCK_THREADS * VECTOR_BYTES // layout.itemsize} wide")
    kernel = _kernel(partial.size, layout, width, float(eps), table_row.size)
    normed, x = kernel(partial.reshape(-1), residual.reshape(-1), weight.astype(partial.dtype),
                       table_row.reshape(-1))
    return normed.reshape(partial.shape), x.reshape(partial.shape)


@functools.lru_cache(maxsize=None)
def _kernel(n: int, layout: Layout, row: int, eps: float | None, table_words: int):
    """n elements in CUDA blocks of `row` elements (one 16-byte vector per thread). eps None: the
    plain all-reduce (row = one chunk); otherwise fused with the residual add and RMSNorm over rows.
    `table_words`: the length of a pointer-table row (Workspace.table)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils

    num_devices = layout.num_devices
    itemsize = layout.itemsize
    dtype = jnp.dtype(layout.dtype)
    block_threads = row * itemsize // VECTOR_BYTES
    fused = eps is not None
    empty = _EMPTY[itemsize]
    empty_word = empty | (empty << 16) if itemsize == 2 else empty

    def body(ctx, *refs):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()
        f32 = ir.F32Type.get()
        ptr_ty = llvm.PointerType.get()
        if fused:
            x_ref, res_ref, w_ref, table_ref, out_ref, res_out_ref, smem = refs
        else:
            x_ref, table_ref, out_ref, _ = refs

        def c32(v):
            return arith.constant(i32, v)

        def c64(v):
            return arith.constant(i64, v)

        def addr_of(ref):
            return llvm.ptrtoint(i64, utils.memref_ptr(ref))

        def word(k):  # table entry k as an unsigned i64
            return arith.extui(i64, memref.load(table_ref, [arith.constant(index, k)]))

        def ld4(addr):  # a 16-byte vector of an input as 4 x i32
            return list(utils.inline_ptx("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", addr,
                                         result_types=[i32] * 4))

        def st4(addr, words, volatile=False, predicate=None):
            op = "st.volatile.global.v4.b32" if volatile else "st.global.v4.b32"
            utils.inline_ptx(f"{op} [$0], {{$1, $2, $3, $4}};", addr, *words, has_side_effects=True,
                             predicate=predicate)

        def poll4(addr, skip):  # spin until no element of the vector is "empty"; skip (i32 != 0): no wait
            label = next(_labels)
            checks = []  # pw: some element is still empty
            for k in range(4):
                halves = [f"${k}"] if itemsize == 4 else ["t", "t"]
                prep = [] if itemsize == 4 else [f"and.b32 t, ${k}, 0xFFFF;", f"shr.u32 t, ${k}, 16;"]
                for h, value in enumerate(halves):
                    checks += prep[h:h + 1]
                    checks.append(f"setp.eq.u32 pw, {value}, {hex(empty)};" if k == h == 0
                                  else f"setp.eq.or.u32 pw, {value}, {hex(empty)}, pw;")
            ptx = "\n".join([
                "{", ".reg .pred pw, ps;", ".reg .b32 t;",
                "mov.b32 $0, 0;", "mov.b32 $1, 0;", "mov.b32 $2, 0;", "mov.b32 $3, 0;",
                "setp.ne.u32 ps, $5, 0;", f"@ps bra AR_DONE_{label};",
                f"AR_WAIT_{label}:", "ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];",
                *checks, f"@pw bra AR_WAIT_{label};",
                f"AR_DONE_{label}:", "}"])
            return list(utils.inline_ptx(ptx, addr, skip, result_types=[i32] * 4, has_side_effects=True))

        def canonical(w):  # -0.0 elements sent as +0.0, so data never looks empty
            if itemsize == 4:
                return arith.select(arith.cmpi(arith.CmpIPredicate.eq, w, c32(empty)), c32(0), w)
            lo, hi = arith.andi(w, c32(0xFFFF)), arith.andi(w, c32(-0x10000))
            lo = arith.select(arith.cmpi(arith.CmpIPredicate.eq, lo, c32(empty)), c32(0), lo)
            hi = arith.select(arith.cmpi(arith.CmpIPredicate.eq, hi, c32(-0x80000000)), c32(0), hi)
            return arith.ori(lo, hi)

        def unpack(words):  # -> f32 values in element order
            if itemsize == 4:
                return [arith.bitcast(f32, w) for w in words]
            out = []
            for w in words:
                out += [arith.bitcast(f32, arith.shli(w, c32(16))), arith.bitcast(f32, arith.andi(w, c32(-0x10000)))]
            return out

        def pack(values):  # f32 values -> words of the dtype, rounded to nearest even
            if itemsize == 4:
                return [arith.bitcast(i32, v) for v in values]
            return [utils.inline_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", hi, lo, result_types=i32)
                    for lo, hi in zip(values[0::2], values[1::2])]

        def rounded(values):  # f32 values rounded to the dtype (and back)
            return values if itemsize == 4 else unpack(pack(values))

        rank = word(0)
        first = 2 + 2 * layout.table_index * num_devices  # this dtype's address set in the table
        bases = [arith.ori(word(first + 2 * j), arith.shli(word(first + 1 + 2 * j), c64(32)))
                 for j in range(num_devices)]
        own = bases[0]
        for j in range(1, num_devices):  # own = bases[rank]
            own = arith.select(arith.cmpi(arith.CmpIPredicate.eq, rank, c64(j)), bases[j], own)

        tid = arith.index_cast(i64, gpu.thread_id(gpu.Dimension.x))
        block = arith.index_cast(i64, gpu.block_id(gpu.Dimension.x))
        vector = arith.addi(arith.muli(block, c64(block_threads)), tid)  # this thread's 16 bytes
        offset = arith.muli(vector, c64(VECTOR_BYTES))
        counter = arith.addi(own, arith.muli(arith.divui(vector, c64(THREADS)), c64(_COUNTER_BYTES)))
        epoch = arith.addi(utils.inline_ptx("ld.volatile.global.u32 $0, [$1];", counter, result_types=i32,
                                            has_side_effects=True), c32(1))
        parity = arith.extui(i64, arith.andi(epoch, c32(1)))

        def slot(base, src):  # address of this thread's vector in slot (parity, src) of a workspace
            k = arith.addi(arith.muli(parity, c64(num_devices)), src)
            return arith.addi(arith.addi(base, c64(layout.data_offset)),
                              arith.addi(arith.muli(k, c64(layout.slot_bytes)), offset))

        mine = [canonical(w) for w in ld4(arith.addi(addr_of(x_ref), offset))]
        others = [arith.cmpi(arith.CmpIPredicate.ne, rank, c64(j)) for j in range(num_devices)]
        for j in range(num_devices):
            st4(slot(bases[j], rank), mine, volatile=True, predicate=others[j])
        total = None
        for j in range(num_devices):
            got = poll4(slot(own, c64(j)), arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, rank, c64(j))))
            words = [arith.select(others[j], g, m) for g, m in zip(got, mine)]
            values = unpack(words)
            total = values if total is None else [arith.addf(a, b) for a, b in zip(total, values)]
        for j in range(num_devices):
            st4(slot(own, c64(j)), [c32(empty_word)] * 4, predicate=others[j])

        if not fused:
            st4(arith.addi(addr_of(out_ref), offset), pack(total))
        else:
            residual = unpack(ld4(arith.addi(addr_of(res_ref), offset)))
            x = rounded([arith.addf(r, s) for r, s in zip(residual, rounded(total))])
            st4(arith.addi(addr_of(res_out_ref), offset), pack(x))
            squares = None
            for v in x:
                squares = arith.mulf(v, v) if squares is None else arith.addf(squares, arith.mulf(v, v))
            for lane_mask in (16, 8, 4, 2, 1):  # butterfly: every lane ends with the warp's sum
                other = utils.inline_ptx(f"shfl.sync.bfly.b32 $0, $1, {lane_mask}, 0x1f, 0xffffffff;",
                                         arith.bitcast(i32, squares), result_types=i32, convergent=True,
                                         has_side_effects=True)
                squares = arith.addf(squares, arith.bitcast(f32, other))
            warp = arith.index_cast(index, arith.divui(tid, c64(32)))
            lane0 = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, c64(32)), c64(0))
            with utils.when(lane0):
                memref.store(squares, smem, [warp])
            utils.inline_ptx("bar.sync 0;", has_side_effects=True, convergent=True)
            ss = None
            for k in range(block_threads // 32):  # every thread: the warps' sums in one order
                part = memref.load(smem, [arith.constant(index, k)])
                ss = part if ss is None else arith.addf(ss, part)
            mean = arith.divf(ss, arith.constant(f32, float(row)))
            inv = utils.inline_ptx("rsqrt.approx.f32 $0, $1;", arith.addf(mean, arith.constant(f32, eps)),
                                   result_types=f32)
            normed = rounded([arith.mulf(v, inv) for v in x])
            weight = unpack(ld4(arith.addi(addr_of(w_ref), arith.muli(tid, c64(VECTOR_BYTES)))))
            st4(arith.addi(addr_of(out_ref), offset), pack([arith.mulf(w, v) for w, v in zip(weight, normed)]))

        utils.inline_ptx("bar.sync 0;", has_side_effects=True, convergent=True)
        first = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, c64(THREADS)), c64(0))
        utils.inline_ptx("st.volatile.global.u32 [$0], $1;", counter, epoch, has_side_effects=True,
                         predicate=first)

    flat = jax.ShapeDtypeStruct((n,), dtype)
    table = jax.ShapeDtypeStruct((table_words,), jnp.int32)
    if fused:
        in_shape = (flat, flat, jax.ShapeDtypeStruct((row,), dtype), table)
        out_shape = (flat, flat)
        smem = jax.ShapeDtypeStruct((MAX_BLOCK_THREADS // 32,), jnp.float32)
    else:
        in_shape, out_shape, smem = (flat, table), flat, ()
    name = "one_shot_all_reduce_rms_norm" if fused else "one_shot_all_reduce"
    with mlir.make_ir_context(), ir.Location.unknown():
        return mgpu.as_gpu_kernel(body, grid=(n // row, 1, 1), block=(block_threads, 1, 1), in_shape=in_shape,
                                  out_shape=out_shape, smem_scratch_shape=smem, module_name=name,
                                  kernel_name=name)
