"""The jitted programs of one engine step: staging the host's step arrays into donated device buffers, and
the forward (+ greedy tokens, + prompt logprobs), with the compiler options that keep a decode step one
CUDA graph. ModelRunner (model_runner.py) calls them, ahead-of-time compiled per bucket."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import registry
from jaxserve.models.layers import ModelBatch
from jaxserve.runner import prompt_logprobs


def pack_step(batch: ModelBatch, prev_index: np.ndarray) -> np.ndarray:
    """The step's host arrays (all int32) as one flat array: one host-to-device copy per device, not eight."""
    return np.concatenate([a.reshape(-1) for a in (*batch, prev_index)])


def _stage_step(staged: ModelBatch, packed, prev_tokens, prev_accepted, prev_drafts=None, *,
                block_size: int | None) -> ModelBatch:
    """The step's inputs (`pack_step`) copied into `staged` (donated: the same device buffers every
    step), with the tokens sampled by the previous step still on device fed in where prev_index >= 0
    (overlap scheduling: their values never went through the host).

    With `block_size` (a speculating engine, whose rows may follow their own verify step still in flight)
    prev_index = i + M * kind (M = max_rows = prev_tokens' length, i a sampling row of the previous step)
    also marks such rows' tokens: kind 1 is the previous step's token i (a decode row behind it, or a
    device-guessed row's input token), kind 1 + j its draft j of row i (prev_drafts [M, k]: a device-guessed
    row's guess j). Their positions, KV slots and their request's sequence length were filled as if that
    step kept none of its guesses; the number it kept (prev_accepted[i]) is added here, the slot recomputed
    from the request's block table. Without it (None) nothing is shifted and prev_accepted is not read."""
    fields, offset = [], 0
    for like in (*staged, staged.token_ids):  # the batch's fields, then prev_index
        fields.append(packed[offset: offset + like.size].reshape(like.shape))
        offset += like.size
    *fields, prev_index = fields
    batch = ModelBatch(*fields)
    if block_size is None:
        from_prev = prev_tokens[jnp.maximum(prev_index, 0)]
        batch = batch._replace(token_ids=jnp.where(prev_index >= 0, from_prev, batch.token_ids))
    else:
        max_rows = prev_tokens.shape[-1]
        kind = jnp.where(prev_index >= 0, prev_index // max_rows, -1)
        index = jnp.maximum(prev_index, 0) % max_rows
        from_prev = prev_tokens[index]
        if prev_drafts is not None:
            guess = prev_drafts[index, jnp.clip(kind - 2, 0, prev_drafts.shape[-1] - 1)]
            from_prev = jnp.where(kind >= 2, guess, from_prev)
        moved = kind >= 1
        shift = jnp.where(moved, prev_accepted[index], 0)
        positions = batch.positions + shift
        num_tokens = positions.shape[-1]
        request = jnp.clip(jnp.searchsorted(batch.query_start_loc, jnp.arange(num_tokens), side="right") - 1,
                           0, batch.seq_lens.shape[-1] - 1)
        max_blocks = batch.block_tables.shape[-1]
        page = jnp.clip(positions // block_size, 0, max_blocks - 1)
        block = batch.block_tables.reshape(-1)[request * max_blocks + page]
        batch = batch._replace(
            token_ids=jnp.where(prev_index >= 0, from_prev, batch.token_ids), positions=positions,
            slot_mapping=jnp.where(moved, block * block_size + positions % block_size, batch.slot_mapping),
            seq_lens=batch.seq_lens.at[request].add(jnp.where(kind == 1, shift, 0)))
    # Written into the donated arrays (returning `batch` itself would hand back its fresh buffers).
    return jax.tree.map(lambda dst, src: jax.lax.dynamic_update_slice(dst, src, (0,) * src.ndim), staged, batch)


stage_fn = jax.jit(_stage_step, donate_argnames=("staged",), keep_unused=True, static_argnames=("block_size",))


@functools.cache
def sharded_stage_fn(sharding: jax.sharding.Sharding):
    """stage_fn whose staged batch comes out in `sharding` (expert parallelism's batch split over the expert
    shards, which the forward expects; left to itself, XLA would hand it back replicated)."""
    return jax.jit(_stage_step, donate_argnames=("staged",), keep_unused=True, out_shardings=sharding,
                   static_argnames=("block_size",))


def _forward_step(params, cfg, batch: ModelBatch, kv_caches, logits_buffer, comm, attention_backend, tp=None,
                  decode_only=False, twin=False, out_rows=None, prompt=None, num_prompt_logprobs=0, placement=None,
                  expert_load=None, return_hidden=False, aux_layers=(), flash_prefill_threshold=0):
    """The model step -> (logits, kv_caches, greedy tokens or None), plus, when `prompt` (the flat token
    indices and scored tokens of prompt_logprobs.PromptRows) is given, prompt_logprobs.compute's arrays
    with `num_prompt_logprobs` top entries. `logits_buffer` (donated, never
    read) gives the logits a buffer that is the same every step, as the staged batch and the donated
    caches are: XLA then replays the step's CUDA graph without updating any node. `decode_only`: every
    request has one query token, token r being request r's (the kernels' decode fast path); such a
    step also returns each row's argmax padded to `out_rows`, which an all-greedy step takes as its
    tokens without launching the sampler. `comm`: the state of tp.all_reduce (None: XLA's
    all-reduces). `twin`: the same step as a second executable (ModelRunner._run_forward alternates).
    `placement`: the expert placement tables under expert parallelism (runner/ep_runner.py), else None; then
    `expert_load` is the running per-expert token count [L, E] int32 (donated) and the step returns it, plus
    this step's load, as its last two outputs: the accumulator (to donate into the next step) and a copy of
    it that is never donated, which the host reads once the step is done (nothing here waits for the host).
    `return_hidden`: every token's final-normed hidden state [T, D] follows the prompt arrays (an EAGLE head
    reads them); with `aux_layers` (an EAGLE-3 head's layers), the residual stream entering each of them,
    concatenated [T, len(aux_layers) * D], instead. `flash_prefill_threshold`: runner.flash_prefill_token_threshold
    (layers.paged_attention; 0: off)."""
    del logits_buffer
    family = registry.family_of(cfg)
    expert = {"placement": placement} if placement is not None else {}
    aux = {"aux_layers": aux_layers} if aux_layers else {}  # (other families' forwards never see the option)
    if flash_prefill_threshold:
        aux["flash_prefill_threshold"] = flash_prefill_threshold
    logits, kv_caches, *hidden = family.forward(params, cfg, batch, kv_caches, attention_backend=attention_backend,
                                                tp=tp, decode_only=decode_only, comm=comm,
                                                return_hidden=prompt is not None or (return_hidden and not aux_layers),
                                                **expert, **aux)
    extra = ()
    if placement is not None:
        *hidden, load = hidden
        expert_load = expert_load + load
        extra = (expert_load, jnp.copy(expert_load))
    if twin:  # a no-op that only makes the program (and so the executable and its CUDA graph) another one
        logits = logits + jnp.zeros((), logits.dtype)
    tokens = None
    if decode_only and out_rows is not None:  # sampler.sample's greedy path without banned ids or penalties
        tokens = jnp.pad(jnp.argmax(logits, axis=-1).astype(jnp.int32), (0, out_rows - logits.shape[0]))
        if tp is not None:  # replicated, as every step's tokens (the next step's stage reads them)
            tokens = jax.lax.with_sharding_constraint(tokens, tp.sharding(()))
    if aux_layers:
        *hidden, features = hidden
    elif return_hidden:
        features = hidden[0]
    extra = (features, *extra) if return_hidden else extra
    if prompt is not None:
        return logits, kv_caches, tokens, prompt_logprobs.compute(params, cfg, hidden[0], *prompt,
                                                                  num_prompt_logprobs), *extra
    return logits, kv_caches, tokens, *extra


# XLA merges sibling matmuls that share an input into one (q/k/v; gate/up) only while the merged weights
# stay under this size; its default (32 MB) leaves the 8B shape's gate/up (2 x 117 MB) as two launches.
# Merged, the concatenation happens inside the GEMM's operand fetch (no copy), so a decode step reads each
# weight pair with one launch and runs faster (benchmarks/RESULTS.md, the gate/up merge).
GPU_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 1024}
# The decode step's twin executable (ModelRunner._run_forward): the same merges (no weight pair is near
# 1 GB), a different option set, so XLA compiles (and the persistent cache keeps) a second executable.
TWIN_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 1025}
# With FP8 weights, the fp8 x fp8 GEMMs of a prefill-sized step (quant.w8a8) go to cuBLASLt: XLA's Triton
# GEMMs for them run at a small fraction of cuBLASLt's rate untuned, and tuning them (compiling and timing
# many Triton configurations per shape) takes minutes per step shape (benchmarks/RESULTS.md, the W8A8
# prefill GEMMs). XLA's autotuner times cuBLASLt's candidate algorithms and keeps the fastest, which costs
# far less compile time than tuning Triton GEMMs.
FP8_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def gpu_compiler_options(fp8_weights: bool, twin: bool = False) -> dict:
    """The step's XLA:GPU options: GPU_COMPILER_OPTIONS (TWIN_COMPILER_OPTIONS for the twin executable),
    with FP8_COMPILER_OPTIONS for a model with FP8 weights."""
    options = TWIN_COMPILER_OPTIONS if twin else GPU_COMPILER_OPTIONS
    return {**options, **FP8_COMPILER_OPTIONS} if fp8_weights else options


@functools.cache
def forward_fn(platform: str, return_hidden: bool = False, aux_layers: tuple[int, ...] = (),
               fp8_weights: bool = False):
    """The jitted step for a platform (GPU options only where XLA:GPU compiles: gpu_compiler_options), one
    per process and option set so engines with the same model config and shapes share compilations;
    `return_hidden`, `aux_layers`: _forward_step's."""
    step = (functools.partial(_forward_step, return_hidden=True, aux_layers=aux_layers) if return_hidden
            else _forward_step)
    return jax.jit(step, static_argnames=("cfg", "attention_backend", "tp", "decode_only", "twin", "out_rows",
                                                   "num_prompt_logprobs", "flash_prefill_threshold"),
                   donate_argnames=("kv_caches", "logits_buffer", "expert_load"), keep_unused=True,
                   compiler_options=gpu_compiler_options(fp8_weights) if platform == "gpu" else None)
