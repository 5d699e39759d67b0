"""Causal GQA flash attention for long prompts: a Mosaic GPU kernel (Hopper: TMA + wgmma).

Same entry signature and semantics as `triton.flash_attention` (read `reference.py`). Dimension
letters as in `jaxserve/models/layers.py`; G = N // K query heads per kv head.

Data flow of one call:

    q [B, Tq, N, H], k/v [B, Tkv, K, H], q_offset [B] int32 (optional)
      (q padded to the q tile, k/v to the KV tile, with zeros when needed)
      plgpu.kernel grid (N / 2, Tq / BQ, B), 3 warpgroups per CTA:
        warpgroups 0 and 1 (consumers): q heads 2i and 2i + 1, the SAME BQ query rows, so both
          read kv head 2i // G and walk the same causal range of K/V tiles;
        warpgroup 2 (producer): TMA-loads K/V tiles of that kv head into a ring of `num_stages`
          SMEM slots; a slot is reloaded once both consumers have arrived on its "free" barrier.
        per KV tile, each consumer: S = Q K^T (wgmma, Q and K from SMEM) -> online softmax in
          registers (exp2, running max in the log2 domain) -> O += P V (wgmma, P from registers)
      out [B, Tq, N, H] (O / l, staged through the Q SMEM buffer and TMA-stored)

Positions: q row i of sequence b is at p = q_offset[b] + i (a fresh prompt: no offset, Tq == Tkv, p = i)
and attends to keys 0..p. A CTA's causal range, its unmasked/diagonal split and the mask all use p: its
tiles wholly at or below its first row's position run unmasked, the ones crossing the diagonal masked,
the ones past its last row's position (or past Tkv) are never loaded. The offsets reach the kernel as an
int32 [B] array in GMEM, of which each CTA's warpgroups load their sequence's entry as a scalar (the way
JAX's Mosaic GPU ragged-dot kernels read their group sizes); rows at or past Tkv are zeros. The fresh
prompt compiles without the offset input, its kernel as before.

Packing two heads of one kv head (rather than two query blocks of one head) keeps both consumers in
lock-step over the same causal tile range: no consumer finishes early, so the producer never waits
on a warpgroup that has left its loop, and the ping-pong rendezvous (FA3: one consumer's softmax
under the other's matmuls) needs no flush loop. Query tiles run longest-first (the grid's q index
is reversed) so the short causal rows fill the last wave.

`benchmarks/prefill_attention.py` times it against cuDNN and the Triton kernel; the figures are in
benchmarks/RESULTS.md.

Scope: causal, no `seq_lens` (a chunk's caller zero-fills K/V past the valid keys instead), bf16/f16,
H % 64 == 0, G even. Everything else goes to the Triton kernel, whose semantics are the same.

`interpret=True` runs this kernel in GPU interpret mode on a CPU (threads, barriers, TMA and wgmma
simulated) with one change: P goes to the P V wgmma through SMEM, because the interpreter's wgmma
reads no register operand; on the device P stays in registers.

NOTE: sm_90a only (wgmma, setmaxnreg).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention import triton

LOG2_E = math.log2(math.e)
NUM_CONSUMERS = 2  # consumer warpgroups per CTA, one q head each
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """block_q: query rows per CTA (each consumer's wgmma M; a multiple of 64).
    block_kv: K/V rows per pipeline step (a multiple of 64).
    num_stages: K/V SMEM ring depth (>= 2); SMEM = 2 * BQ * H + 2 * num_stages * BKV * H elements.
    pingpong: order the two consumers' wgmmas with a rendezvous barrier (FA3's ping-pong), so
        one warpgroup's softmax runs while the other's matmuls hold the tensor cores.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    pingpong: bool = True  # faster than without on Hopper at both prompt lengths benchmarked (RESULTS.md)

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 64 or value % 64:
                raise ValueError(f"{name}={value!r} must be a positive multiple of 64 (wgmma tiles)")
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 4:
            raise ValueError(f"num_stages={self.num_stages!r} must be an int in 2..4")


def supports(q, k, *, causal: bool, seq_lens) -> bool:
    """Whether `q`/`k` fit this kernel's scope (else the Triton kernel serves the call).

    Head dims above 128 are left to Triton: the shared-memory ring (~1280 * head_dim bytes with the
    default config) would pass Hopper's 227 KiB, and the accumulator its register budget."""
    num_q_heads, head_dim = q.shape[2], q.shape[3]
    group = num_q_heads // k.shape[2]
    return (causal and seq_lens is None and jnp.dtype(q.dtype) in _DTYPES
            and head_dim % 64 == 0 and head_dim <= 128 and group % NUM_CONSUMERS == 0)


def _kernel(*refs, config: MosaicAttentionConfig, num_q_tiles: int, group: int, scale_log2: float,
            has_offset: bool, kv_len: int, interpret: bool):
    if has_offset:  # offsets [B] int32 in GMEM: a scalar load of this CTA's entry
        offsets_ref, *refs = refs
    (q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, turn,
     *p_smem) = refs
    p_smem = p_smem[0] if interpret else None
    block_q, block_kv, stages = config.block_q, config.block_kv, config.num_stages
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    batch = lax.axis_index("batch")
    head_pair = lax.axis_index("heads")
    q_tile = num_q_tiles - 1 - lax.axis_index("q")  # longest causal rows first
    q_start = q_tile * block_q  # the block's first row in q
    # The block's first row's absolute position (= its key index): row i of q sits at offset + i.
    q_pos = q_start + offsets_ref[batch] if has_offset else q_start
    kv_head = lax.div(head_pair * NUM_CONSUMERS, jnp.int32(group))
    num_steps = lax.div(q_pos + block_q + block_kv - 1, jnp.int32(block_kv))
    if has_offset:  # keys past the (static) K/V length are never read
        num_steps = jnp.minimum(num_steps, jnp.int32(k_ref.shape[1] // block_kv))
    wg = lax.axis_index("wg")

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        head = head_pair * NUM_CONSUMERS + wg
        my_q = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, block_q), head], my_q,
                                q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

        def rendezvous():
            if config.pingpong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        def step(j, carry, masked: bool):
            acc, m, l = carry  # acc [BQ, H] f32, m and l [BQ] f32 (m in the log2 domain)
            slot = lax.rem(j, jnp.int32(stages))
            plgpu.barrier_wait(k_ready.at[slot])

            def scores(s_ref):
                plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                rendezvous()  # the other consumer issues its next matmul only after this one
                return s_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                              layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                              layout=plgpu.Layout.WGMMA)
                s = jnp.where(q_pos + rows >= j * block_kv + cols, s, -jnp.inf)
            # Every row sees key 0 in step 0, so m is finite from then on: no -inf - -inf.
            m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p = p.astype(dtype)
            if p_smem is not None:  # interpret mode: its wgmma takes operands from SMEM only
                p_smem.at[wg][...] = p
                plgpu.commit_smem()
                p = p_smem.at[wg]
            if config.pingpong:  # softmax done; issue P V once the other consumer's turn ends
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)
            else:
                plgpu.barrier_wait(v_ready.at[slot])

            def values(pv_ref):
                plgpu.wgmma(pv_ref, p, v_smem.at[slot])
                return pv_ref[...]

            # NOTE: P V into a fresh accumulator, then one FMA with the rescale: GPU interpret
            # mode cannot run `pl.run_state` on an accumulator, and the cost is the same.
            pv = pl.run_scoped(values, plgpu.ACC((block_q, head_dim), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
            return acc, m_new, l

        carry = (
            plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        # Ping-pong: consumer 1 starts one rendezvous late, so each consumer's two matmuls fall
        # in the other's softmax; both run the same steps, so one closing rendezvous evens out.
        pl.when(wg == 1)(rendezvous)
        # Tiles wholly at or below the block's first row need no mask; the rest cross the diagonal.
        unmasked = lax.div(q_pos + 1, jnp.int32(block_kv))
        if has_offset:
            unmasked = jnp.minimum(unmasked, num_steps)
        carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(unmasked, num_steps, functools.partial(step, masked=True), carry)
        pl.when(wg == 0)(rendezvous)
        acc, _, l = carry
        acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
        if has_offset:  # rows at or past the K/V length are padding: zeros, as in the reference
            rows = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
            acc = jnp.where(q_pos + rows < kv_len, acc, 0.0)
        my_q[...] = acc.astype(dtype)  # Q is dead after the last QK^T: reuse its SMEM
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, o_ref.at[batch, pl.ds(q_start, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def load(j, slot):
            rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        for j in range(min(stages, k_ref.shape[1] // block_kv)):  # static slices must be in bounds
            pl.when(j < num_steps)(functools.partial(load, j, j))

        @pl.loop(stages, num_steps)
        def _(j):
            slot = lax.rem(j, jnp.int32(stages))
            rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        # Observe each slot's last release too: every barrier phase is waited on before the CTA
        # exits (GPU interpret mode checks this; on the device it costs an idle producer nothing).
        for slot in range(stages):
            @pl.when(slot < num_steps)
            def _():
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])


def _transforms(minor: int, dtype):
    """SMEM tiling + swizzle for a [rows, minor] wgmma operand (the widest swizzle that fits)."""
    row_bytes = minor * jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if row_bytes % s == 0)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _mosaic_attention(q, k, v, q_offset=None, *, sm_scale: float, config: MosaicAttentionConfig,
                      kv_len: int, interpret: plgpu.InterpretGPUParams | None = None):
    """The kernel; q's rows a multiple of block_q, k/v's a multiple of block_kv. `q_offset` [B] int32
    (None: q and k/v the same length, row i at position i); `kv_len`: the keys before padding (rows at or
    past it are zeros; offset calls only). `interpret` runs it in GPU interpret mode (CPU), with P staged
    through SMEM (the interpreter's wgmma reads no register operands)."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[2]
    num_q_tiles = num_tokens // config.block_q
    transforms = _transforms(head_dim, q.dtype)
    stages = config.num_stages
    has_offset = q_offset is not None
    kernel = functools.partial(_kernel, config=config, num_q_tiles=num_q_tiles, group=group,
                               scale_log2=float(sm_scale) * LOG2_E, has_offset=has_offset, kv_len=kv_len,
                               interpret=interpret is not None)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(
            plgpu.SMEM((NUM_CONSUMERS, config.block_q, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, config.block_kv, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, config.block_kv, head_dim), q.dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=NUM_CONSUMERS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS),  # the ping-pong turn (unused without it)
            *([] if interpret is None else [plgpu.SMEM(
                (NUM_CONSUMERS, config.block_q, config.block_kv), q.dtype,
                transforms=_transforms(config.block_kv, q.dtype))]),
        ),
        # NOTE: heads vary fastest, so the CTAs reading one kv head's K/V run together (L2).
        grid=(num_q_heads // NUM_CONSUMERS, num_q_tiles, batch),
        grid_names=("heads", "q", "batch"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(*([q_offset] if has_offset else []), q, k, v)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "config", "interpret"))
def flash_attention(
    q: jax.Array,  # [B, Tq, N, H]
    k: jax.Array,  # [B, Tkv, K, H]
    v: jax.Array,  # [B, Tkv, K, H]
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    seq_lens: jax.Array | None = None,  # [B] int32, valid keys per sequence (<= Tkv)
    q_offset: jax.Array | None = None,  # [B] int32, the absolute position of q's row 0 (None: 0)
    config: MosaicAttentionConfig | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Tq, N, H], q.dtype
    """`triton.flash_attention` on Hopper's TMA + wgmma; calls outside `supports` go to Triton."""
    triton._check_inputs(q, k, v, seq_lens, q_offset)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    if not supports(q, k, causal=causal, seq_lens=seq_lens):
        return triton.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, seq_lens=seq_lens,
                                      q_offset=q_offset, interpret=interpret)
    config = MosaicAttentionConfig() if config is None else config
    params = plgpu.InterpretGPUParams() if interpret else None
    num_tokens, kv_len = q.shape[1], k.shape[1]
    if q_offset is None:  # a fresh prompt (Tq == Tkv): q row i is key i
        tile = math.lcm(config.block_q, config.block_kv)
        padded = -(-num_tokens // tile) * tile
        if padded != num_tokens:
            # NOTE: causal, so padded keys (after every real row) are never seen by a real row.
            pad = ((0, 0), (0, padded - num_tokens), (0, 0), (0, 0))
            q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        out = _mosaic_attention(q, k, v, sm_scale=sm_scale, config=config, kv_len=kv_len, interpret=params)
        return out[:, :num_tokens]
    # NOTE: padded keys sit at positions >= kv_len, seen only by rows at or past kv_len (zeros).
    q_pad, kv_pad = -num_tokens % config.block_q, -kv_len % config.block_kv
    if q_pad:
        q = jnp.pad(q, ((0, 0), (0, q_pad), (0, 0), (0, 0)))
    if kv_pad:
        k, v = (jnp.pad(x, ((0, 0), (0, kv_pad), (0, 0), (0, 0))) for x in (k, v))
    out = _mosaic_attention(q, k, v, jnp.maximum(q_offset.astype(jnp.int32), 0), sm_scale=sm_scale,
                            config=config, kv_len=kv_len, interpret=params)
    return out[:, :num_tokens]
