"""ModelRunner's start-up compilation: every step shape, sampler variant and verification program,
ahead of time, so that no step traces or compiles."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxserve.models.layers import ModelBatch
from jaxserve.runner import model_runner, prompt_logprobs, sampler, spec_verify
from jaxserve.runner.step_program import gpu_compiler_options, pack_step
from sharding.tensor_parallel import zeros

logger = logging.getLogger(__name__)
SLOWEST_LOGGED = 5


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def precompile(runner, progress: bool = True) -> int:
    """Compile every (T, R) forward bucket, the prompt-logprob variant of each T, and every sampler
    variant, then run the forward and sampler programs once (`warm`); returns the number compiled.
    `runner.slowest_compiles`: the SLOWEST_LOGGED slowest jobs as (key, seconds), key like
    "forward 512 16 False" (its kind, T, R, decode-only).

    Each one is lowered and compiled ahead of time in a thread pool (XLA compiles without holding
    the GIL, so the shapes compile side by side; warm starts read the persistent cache side by
    side too), and the step then calls these executables directly.
    """
    plan = runner.buckets.precompile_plan()
    # (all greedy, penalties, logprobs, top-k / top-p sort): the sort only where rows sample at random
    variants = [(g, p, lp, sort) for g in (True, False) for p in (False, True) for lp in (0, runner.max_logprobs)
                for sort in ((False,) if g else (False, True))]
    prev_tokens = runner._zeros((runner.max_rows,), jnp.int32)

    on_device = runner.on_device  # where the step's small arrays and the logits live

    def device_batch(t_pad: int, r_pad: int) -> ModelBatch:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=runner.batch_sharding),
                            runner._host_batch(t_pad, r_pad))

    def forward(t_pad: int, r_pad: int, decode_only: bool, prompt: bool = False):
        logits = jax.ShapeDtypeStruct((r_pad * runner.num_shards, runner.cfg.vocab_size), jnp.float32,
                                      sharding=runner.logits_sharding)
        extra = runner._expert_args()
        if prompt:
            num_rows = prompt_logprobs.num_rows(t_pad, runner.max_prompt_logprob_rows)
            rows = jax.ShapeDtypeStruct((num_rows,), jnp.int32, sharding=on_device)
            extra |= {"prompt": (rows, rows), "num_prompt_logprobs": runner.max_logprobs}
        lowered = runner.forward_fn.lower(runner.model.params, runner.cfg, device_batch(t_pad, r_pad), runner.kv_caches,
                                        logits, runner.comm, attention_backend=runner.attention_backend, tp=runner.tp,
                                        flash_prefill_threshold=runner.flash_prefill_threshold,
                                        decode_only=decode_only, out_rows=runner.max_rows, **extra)
        if prompt:
            return {("forward_prompt", t_pad, r_pad): lowered.compile()}
        if not (runner.use_twins and (decode_only or runner.speculative)):
            return {("forward", t_pad, r_pad, decode_only, False): lowered.compile()}
        # The twin (decode steps; with speculation also the shapes a verify step takes): the same program
        # compiled once more (an option that changes nothing makes it a separate executable, without
        # lowering the step twice).
        twin = gpu_compiler_options(runner.fp8_weights, twin=True)
        return {("forward", t_pad, r_pad, decode_only, False): lowered.compile(),
                ("forward", t_pad, r_pad, decode_only, True): lowered.compile(twin)}

    def stage(t_pad: int, r_pad: int):
        batch = runner._host_batch(t_pad, r_pad)
        packed = pack_step(batch, np.full(batch.token_ids.shape, -1, np.int32))
        drafts = runner._no_drafts
        return runner.stage_fn.lower(device_batch(t_pad, r_pad), packed, prev_tokens, prev_tokens, drafts,
                                     block_size=runner.stage_block_size).compile()

    def sample(rows: int, all_greedy: bool, use_penalties: bool, num_logprobs: int, sort: bool):
        md = sampler.empty_metadata(rows, model_runner.MAX_BANNED, runner.max_model_len if use_penalties else 1)
        logits = jax.ShapeDtypeStruct((rows, runner.cfg.vocab_size), jnp.float32, sharding=runner.logits_sharding)
        shift = runner._no_accepted if runner.speculative else None  # (ModelRunner.dispatch's prev_accepted)
        return sampler.sample.lower(logits, md, shift, all_greedy=all_greedy, use_penalties=use_penalties,
                                    num_logprobs=num_logprobs, sort=sort, out_rows=runner.max_rows,
                                    tokens_sharding=runner.tokens_sharding).compile()

    jobs = {("forward", t_pad, r_pad, False): (forward, (t_pad, r_pad, False)) for t_pad, r_pad in plan}
    jobs.update({("forward", t_pad, r_pad, True): (forward, (t_pad, r_pad, True))
                 for t_pad, r_pad in runner.buckets.decode_plan()})
    jobs.update({("forward_prompt", t_pad, r_pad): (forward, (t_pad, r_pad, False, True))
                 for t_pad, r_pad in runner._prompt_requests.items()})
    jobs.update({("stage", t_pad, r_pad): (stage, (t_pad, r_pad)) for t_pad, r_pad in runner._step_shapes})
    # The buffers the steps reuse, made now so that no step traces their fill.
    for t_pad, r_pad in runner._step_shapes:
        runner._staged.setdefault((t_pad, r_pad), runner._zeros_like_batch(t_pad, r_pad))
    for r_pad in runner.buckets.request_buckets:
        runner._logits.setdefault(r_pad, zeros((r_pad * runner.num_shards, runner.cfg.vocab_size), jnp.float32,
                                             runner.logits_sharding))
    jobs.update({("sample", r_pad * runner.num_shards, *variant): (sample, (r_pad * runner.num_shards, *variant))
                 for r_pad in runner.buckets.request_buckets for variant in variants})
    if runner.speculative:
        jobs.update(spec_verify.compile_jobs(runner.max_rows, on_device, runner.synthetic_acceptance is not None,
                                             runner.proposer.k if runner.proposer is not None else 0))
    if runner.ngram is not None:
        jobs.update(runner.ngram.precompile_jobs(runner))
    # The draft's programs compile after the others, one at a time and without the persistent cache:
    # XLA:CPU crashed now and then serializing them into it (or reading them back).
    draft_jobs = runner.drafter.precompile_jobs(runner) if runner.drafter is not None else {}
    bar = tqdm(total=len(jobs) + len(draft_jobs), desc="compiling buckets", disable=not progress, leave=False)
    seconds = {}  # job key -> its lowering and compiling time (in a thread, beside the others)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {pool.submit(_timed, fn, *args): key for key, (fn, args) in jobs.items()}
        for future in concurrent.futures.as_completed(futures):
            result, seconds[futures[future]] = future.result()
            runner._compiled.update(result if isinstance(result, dict) else {futures[future]: result})
            bar.update()
    if draft_jobs:  # (a compile-time floor no compile reaches: nothing is written, so nothing is read back)
        floor = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
        try:
            for key, (fn, args) in draft_jobs.items():  # (each job's result: {key: executable})
                result, seconds[key] = _timed(fn, *args)
                runner._compiled.update(result)
                bar.update()
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", floor)
    bar.close()
    warm_start = time.perf_counter()
    num_warmed = warm(runner)
    logger.info("warm-up: ran %d step, sampler and verification programs once in %.1f s", num_warmed,
                time.perf_counter() - warm_start)
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST_LOGGED]
    runner.slowest_compiles = [(" ".join(map(str, key)), round(s, 2)) for key, s in slowest]
    logger.info("precompile: %d jobs in %.1f s; slowest: %s", len(seconds), time.perf_counter() - start,
                ", ".join(f"{key} {s} s" for key, s in runner.slowest_compiles))
    return len(runner._compiled)


def warm_batch(runner, t_pad: int, r_pad: int, length: int = 1) -> tuple[ModelBatch, np.ndarray]:
    """A (T, R) step of one request of `length` tokens from position 0 whose K/V go to the null block 0
    (never read as a prefix), the rest padding as `fill_batch` pads; and its prev_index (no token from
    the step before)."""
    batch = runner._host_batch(t_pad, r_pad)
    batch.positions[..., :length] = np.arange(length, dtype=np.int32)
    batch.query_start_loc[..., 1:] = length
    batch.seq_lens[..., 0] = length
    return batch, np.full(batch.token_ids.shape, -1, np.int32)


def _lengths(runner, t_pad: int, decode_only: bool) -> list[int]:
    """The request lengths the warm-up runs a (T, R) forward with: one token; and where the forward has the
    long-prefill branch (layers.attention: a request of at least flash_prefill_threshold query rows runs
    the flash attention), a request of T tokens, as long as the context allows, to run that branch too."""
    threshold = runner.flash_prefill_threshold
    longest = min(t_pad, runner.max_blocks * runner.block_size)
    return [1, longest] if threshold > 0 and not decode_only and t_pad >= threshold and longest >= threshold else [1]


def warm(runner) -> int:
    """Runs each precompiled forward (both twins where a shape has two; the prompt-logprob variants; the
    long-prefill branch where a shape has one), sampler and verification program once, on steps whose K/V
    go to the null block (a verification with no guesses), and waits for them; returns the number of runs.
    (A proposer's own programs still initialize on first use.)

    A GPU executable finishes initializing on its first run: XLA loads its kernels into the CUDA context
    (cuModuleLoadData; a Pallas kernel in a branch loads when the branch first runs) and instantiates its
    CUDA graphs. Left to serving, that first run comes in the middle of traffic, and loading a module
    waits for the work in flight on the device, so the engine thread stalls for the rest of the step
    before it. Here it happens before the first request. Every process of a multi-host engine runs the
    same programs in the same order (precompile is broadcast)."""
    prev_tokens = runner._zeros((runner.max_rows,), jnp.int32)
    outputs, forwards = [], 0  # (a forward's outputs are donated by the next run of its shape: not kept)
    # (T, R, decode-only, prompt-logprob variant) of every forward, in one order in every process
    steps = sorted({(*key[1:4], False) for key in runner._compiled if key[0] == "forward"}
                   | {(*key[1:], False, True) for key in runner._compiled if key[0] == "forward_prompt"})
    for t_pad, r_pad, decode_only, scores_prompt in steps:
        twins = not scores_prompt and ("forward", t_pad, r_pad, decode_only, True) in runner._compiled
        prompt = None
        if scores_prompt:
            scored = np.zeros(prompt_logprobs.num_rows(t_pad, runner.max_prompt_logprob_rows), np.int32)
            prompt = prompt_logprobs.PromptRows(scored, scored, [])
        for length in _lengths(runner, t_pad, decode_only):
            for _ in range(2 if twins else 1):
                batch, prev_index = warm_batch(runner, t_pad, r_pad, length)
                runner._run_forward(batch, prev_tokens, prev_index, decode_only, prompt=prompt, twins=twins,
                                    prev_drafts=runner._no_drafts)
                forwards += 1
    shift = runner._no_accepted if runner.speculative else None
    for key in sorted(key for key in runner._compiled if key[0] == "sample"):  # (one order in every process)
        rows, _, use_penalties, *_ = key[1:]
        md = sampler.empty_metadata(rows, model_runner.MAX_BANNED, runner.max_model_len if use_penalties else 1)
        logits = zeros((rows, runner.cfg.vocab_size), jnp.float32, runner.logits_sharding)
        outputs.append(runner._compiled[key](logits, md, shift))
    for key in sorted(key for key in runner._compiled if key[0] == "verify"):
        device = key[1]
        rows = runner._zeros((runner.max_rows,), jnp.int32)
        packed = np.zeros((spec_verify.PACKED_FIELDS, runner.max_rows), np.int32)
        packed[[0, 2, 3]] = -1  # (no row checks a guess)
        outputs.append(runner._compiled[key](rows, packed, *((runner._no_drafts, rows) if device else ())))
    jax.block_until_ready((outputs, runner.kv_caches, runner._staged, runner._logits))
    return forwards + len(outputs)
