"""SchedulerOutput -> padded device arrays -> jitted forward + sampler -> RunnerOutput.

    dispatch(out): reset the rows of (re)started requests, append new block ids; gather each row's
      step tokens, positions and slots (block id * S + offset) -> ModelBatch padded to the (T, R)
      buckets -> stage(one packed host array, previous step's tokens on device) into the shape's
      donated device buffers -> forward(params, staged batch, kv_caches donated, logits buffer donated)
      -> logits of sampling rows -> sample(logits, SamplingMetadata) -> tokens copying to the host
      -> StepHandle (returns without waiting)
    collect(handle): wait for the tokens, append them to their rows -> RunnerOutput
    execute(out) = collect(dispatch(out))

A step with prefill chunks of requests asking prompt logprobs runs the forward's prompt-logprob
variant instead (runner/prompt_logprobs.py); its results come back with the step's RunnerOutput.

Per-request state lives in fixed rows of preallocated numpy arrays (the scheduler assigns the
rows), so a step gathers rows with one fancy index instead of rebuilding them. With overlap, step
N+1 is dispatched before step N is collected: tokens not yet on the host are read on device from
step N's sampled-token array (prev_index), and a row reset in between drops its stale token.
Every jitted shape comes from core/buckets.py and all of them are compiled in `precompile()`.
The forward reads and writes the same device buffers whenever a shape recurs (decode steps, and the verify
steps of speculative decoding, alternate between two twin executables, each keeping its own temporaries),
so XLA replays its CUDA graph without updating it: updating a graph's nodes would cost most of a decode
step's host time (benchmarks/RESULTS.md).
The jitted programs themselves are in step_program.py; ep_runner.py builds expert parallelism's steps
(one sub-batch per expert shard) on this class.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketLadders
from jaxserve.core.sched_types import (MAX_PROMPT_LOGPROB_ROWS, NewRequestData, RunnerOutput,
                                       SchedulerOutput)
from jaxserve.models import registry
from jaxserve.models.layers import ModelBatch
from jaxserve.models.loader import LoadedModel
from jaxserve.runner import draft_runner, ngram_runner, prompt_logprobs, sampler, spec_verify
from jaxserve.runner.device_setup import (enable_compilation_cache, flash_prefill_threshold, kv_cache_dtype,
                                         kv_cache_num_blocks, load_model, resolve_attention_backend,
                                         resolve_max_model_len, setup_all_reduce, with_kv_scales)
from jaxserve.runner.step_program import forward_fn, pack_step, stage_fn
from jaxserve.runner.step_types import HostStep, StepHandle, StepRows
from pallas_kernels.paged_attention import fp8
from sharding import TensorParallel
from sharding.tensor_parallel import zeros

logger = logging.getLogger(__name__)

MAX_BANNED = 16  # eos + stop token ids suppressed while a request is below min_tokens

class ModelRunner:
    supports_prompt_logprobs = True  # compiles a prompt-logprob variant per token bucket and reserves its memory

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, *, model: LoadedModel | None = None):
        """Loads config.model (unless `model` is given: already loaded and placed) and sets up the step on
        `tp`'s mesh, or on the default device without `tp`. The engine reads the model's facts from here:
        `model` (config, generation defaults), `max_model_len`, `num_blocks`."""
        enable_compilation_cache(config.runner.compilation_cache_dir)
        start = time.monotonic()
        model = model if model is not None else load_model(config, tp)
        self.load_seconds = time.monotonic() - start
        max_model_len = resolve_max_model_len(config, model.config)
        self.model = model
        # The step's all-reduces: XLA's, or a peer-memory kernel whose state (`comm`) lives with the runner.
        self.tp, self.comm, self._all_reduce_workspace = setup_all_reduce(tp, config.parallel.all_reduce,
                                                                          model.config.jnp_dtype)
        # where the step's small arrays and logits live: replicated on the mesh, or the params' device
        self.on_device = tp.sharding(()) if tp is not None else jax.tree.leaves(model.params)[0].sharding
        # where the staged batch and the logits live (split over the expert shards in ep_runner.py)
        self.batch_sharding = self.logits_sharding = self.on_device
        self.placement = self.expert_load = None  # the expert placement tables, load counts (ep_runner.py)
        self.stage_fn = stage_fn
        self.tokens_sharding = None  # the sampled tokens' (replicated: ep_runner.py), None: as XLA leaves them
        # the step's sub-batches: one per expert shard, each with max_num_seqs rows of its own (ep_runner.py)
        self.num_shards = tp.expert_size if tp is not None else 1
        self.cfg = model.config
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.attention_backend = resolve_attention_backend(config.runner.attention_backend, self.cfg,
                                                           self.block_size)
        self.slowest_compiles: list[tuple[str, float]] = []  # precompile(): its slowest jobs (key, seconds)
        self.flash_prefill_threshold = flash_prefill_threshold(config.runner.flash_prefill_token_threshold,
                                                               self.attention_backend)
        sched = config.scheduler
        self.buckets = BucketLadders.build(sched.max_num_batched_tokens, sched.max_num_seqs,
                                           config.runner.token_buckets, config.runner.request_buckets)
        self.max_blocks = math.ceil(max_model_len / self.block_size)
        if self.tp is not None and self.tp.all_reduce is not None:
            probe = [jax.ShapeDtypeStruct((t, self.cfg.hidden_size), self.cfg.jnp_dtype)
                     for t in set(self.buckets.token_buckets) | {t for t, _ in self.buckets.decode_plan()}]
            if not any(self.tp.all_reduce.fits(x) for x in probe):
                logger.warning("parallel.all_reduce: the one-shot kernel fits none of this model's step shapes "
                               "(hidden_size %d x tokens must be whole kernel chunks); XLA's all-reduce runs "
                               "everywhere", self.cfg.hidden_size)
        # the step buffers precompile() makes (_run_forward): staged inputs per shape, f32 logits per R
        self._step_shapes = sorted(set(self.buckets.precompile_plan()) | set(self.buckets.decode_plan()))
        self.max_logprobs = self.cfg.vocab_size if sched.max_logprobs == -1 else min(sched.max_logprobs,
                                                                                     self.cfg.vocab_size)
        # prompt positions one step scores at most (the scheduler keeps to it: engine.py passes it on)
        self.max_prompt_logprob_rows = MAX_PROMPT_LOGPROB_ROWS
        # ... and the largest prompt-logprob variant's outputs and temporaries
        reserved = (sum(a.nbytes for t, r in self._step_shapes for a in self._host_batch(t, r))
                    + 4 * sum(self.buckets.request_buckets) * self.cfg.vocab_size)
        if self.supports_prompt_logprobs:
            reserved += max(prompt_logprobs.device_bytes(t, self.max_prompt_logprob_rows, self.cfg.vocab_size,
                                                         self.max_logprobs) for t in self.buckets.token_buckets)
        # the draft model or EAGLE head (speculative.method draft_model, eagle): its K/V shares the blocks
        self.drafter = draft_runner.make(config, tp, self.cfg, max_model_len)
        draft_bytes = self.drafter.memory(self.buckets) if self.drafter else (0, 0)  # (step buffers, per block)
        # the KV cache's dtype (fp8: 1 byte per element, so about twice the blocks of a bf16 cache fit)
        self.kv_dtype = kv_cache_dtype(config, self.cfg, self.attention_backend)
        if fp8.is_fp8(self.kv_dtype):
            self.model = model = with_kv_scales(model, config, tp)
        self.num_blocks = kv_cache_num_blocks(self.cfg, config, max_model_len, np.dtype(self.kv_dtype).itemsize, tp,
                                              reserved + draft_bytes[0], extra_block_bytes=draft_bytes[1])
        self.kv_caches = registry.family_of(self.cfg).init_kv_caches(self.cfg, self.num_blocks, self.block_size,
                                                                     self.attention_backend, dtype=self.kv_dtype,
                                                                     tp=tp)

        # Per-row state (rows are assigned by the scheduler), so a step gathers rows with fancy indexing
        # instead of per-request Python.
        rows = sched.max_num_seqs * self.num_shards
        self.token_buf = np.zeros((rows, max_model_len), np.int32)  # every token id of a row known on the host
        self.block_table = np.zeros((rows, self.max_blocks), np.int32)
        self.row_num_tokens = np.zeros(rows, np.int64)  # tokens of the row in token_buf
        self.row_num_prompt = np.zeros(rows, np.int64)
        self.row_num_blocks = np.zeros(rows, np.int64)
        self.row_pending = np.zeros(rows, np.int64)  # tokens sampled by dispatched steps, not yet collected
        self.row_prev_index = np.zeros(rows, np.int64)  # the row's index in the last step's sampled tokens
        self.row_generation = np.zeros(rows, np.int64)  # bumped when a row is reset, to drop stale tokens
        self.row_data: list[NewRequestData | None] = [None] * rows
        self.sampling_rows = sampler.empty_metadata(rows, MAX_BANNED, 1)
        self.row_greedy = np.zeros(rows, bool)
        self.row_penalties = np.zeros(rows, bool)
        self.row_logprobs = np.zeros(rows, bool)
        self.row_prompt_logprobs = np.zeros(rows, bool)
        self.row_min_tokens = np.zeros(rows, np.int64)
        # Sampled tokens come back padded to the largest request bucket, so the next step reads them
        # from the device with one compiled shape.
        self.max_rows = self.buckets.request_buckets[-1] * self.num_shards
        self._no_accepted = self._zeros((self.max_rows,), jnp.int32)  # a step's prev_accepted after a plain step
        self._no_drafts = None  # a step's prev_drafts after one that drafted nothing (with a proposer)
        self.row_drafts: dict[int, list[int]] = {}  # row -> the drafts of its last collected step that drafted
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self.ngram = ngram_runner.make(config, rows, max_model_len, self.max_rows, self.on_device, self._compiled)
        self.proposer = self.drafter or self.ngram  # what makes each step's drafts on device, if anything
        if self.drafter is not None:
            self.drafter.init_caches(self.num_blocks, self.max_rows, self.on_device)
        if self.proposer is not None:
            self._no_drafts = self._zeros((self.max_rows, self.proposer.k), jnp.int32)
        # A prompt-logprob step of T tokens pads its requests to the largest bucket T pairs with.
        self._prompt_requests = {t: max(r for t2, r in self.buckets.precompile_plan() if t2 == t)
                                 for t in self.buckets.token_buckets} if self.supports_prompt_logprobs else {}
        self._last: StepHandle | None = None  # the last dispatched step
        # Ahead-of-time executables by ("forward", T, R, decode_only, twin) / ("forward_prompt", T, R) /
        # ("stage", T, R) / ("sample", logits rows, variant...), from precompile() (self._compiled, above).
        # Device buffers reused by donation (_run_forward): staged inputs by (T, R), logits by R.
        self._staged: dict[tuple[int, int], ModelBatch] = {}
        self._logits: dict[int, jax.Array] = {}
        self._twin: dict[tuple[int, int, bool], bool] = {}  # the twin the last step of a (T, R, decode_only) ran
        platform = (tp.mesh.devices.flat[0] if tp is not None else jax.devices()[0]).platform
        self.fp8_weights = getattr(self.cfg, "quantization", None) is not None
        self.forward_fn = forward_fn(platform, self.drafter is not None and self.drafter.needs_hidden,
                                     self.drafter.aux_layers if self.drafter is not None else (), self.fp8_weights)
        self.use_twins = platform == "gpu"  # (only XLA:GPU replays graphs; see _run_forward)
        self.speculative = config.speculative.enabled  # steps may carry guesses (spec_verify.py)
        # The staging program's block size where a row may follow its own verify step (step_program._stage_step
        # moves such rows on device), None where none can.
        self.stage_block_size = self.block_size if self.speculative else None
        # The bench's synthetic acceptance (spec_verify.py): a step input, changed between runs without a compile
        self.synthetic_acceptance = config.speculative.synthetic_acceptance

    def _zeros(self, shape: tuple[int, ...], dtype) -> jax.Array:
        return zeros(shape, dtype, self.on_device)

    def _host_batch(self, t_pad: int, r_pad: int) -> ModelBatch:
        """A step's host arrays for the (T, R) buckets, zeroed (the shapes `prepare` fills)."""
        return ModelBatch(np.zeros(t_pad, np.int32), np.zeros(t_pad, np.int32), np.zeros(t_pad, np.int32),
                          np.zeros(r_pad + 1, np.int32), np.zeros(r_pad, np.int32),
                          np.zeros((r_pad, self.max_blocks), np.int32), np.zeros(r_pad, np.int32))

    def _zeros_like_batch(self, t_pad: int, r_pad: int) -> ModelBatch:
        """Device buffers for a (T, R) step's staged inputs."""
        return jax.tree.map(lambda a: zeros(a.shape, a.dtype, self.batch_sharding), self._host_batch(t_pad, r_pad))

    # ---- per-row state ----
    def _reset_row(self, row: int, data: NewRequestData) -> None:
        num_tokens = len(data.all_token_ids)
        self.token_buf[row, :num_tokens] = data.all_token_ids
        self.row_num_tokens[row] = num_tokens
        self.row_num_prompt[row] = data.num_prompt_tokens
        self.row_num_blocks[row] = 0
        self.row_pending[row] = 0
        self.row_generation[row] += 1
        self.row_data[row] = data
        params = data.sampling_params
        md = self.sampling_rows
        md.temperature[row] = params.temperature
        md.top_k[row] = params.top_k if params.top_k > 0 else 0
        md.top_p[row] = params.top_p
        md.min_p[row] = params.min_p
        md.repetition_penalty[row] = params.repetition_penalty
        md.presence_penalty[row] = params.presence_penalty
        md.frequency_penalty[row] = params.frequency_penalty
        md.seeds[row] = sampler.seed_words(data.seed)
        self.row_greedy[row] = params.temperature == 0.0
        self.row_penalties[row] = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                                   or params.frequency_penalty != 0.0)
        self.row_logprobs[row] = params.logprobs is not None
        self.row_prompt_logprobs[row] = params.prompt_logprobs is not None
        self.row_min_tokens[row] = params.min_tokens
        if self.ngram is not None:
            self.ngram.reset(row, data.all_token_ids)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.row_num_blocks[row]
        self.block_table[row, start: start + len(block_ids)] = block_ids
        self.row_num_blocks[row] = start + len(block_ids)

    # ---- one step ----
    def step_rows(self, out: SchedulerOutput) -> StepRows:
        """Applies a scheduler output's row updates (resets, new blocks) and lays out its requests."""
        items = out.scheduled
        for row, num_blocks in out.truncated_block_tables:  # (slots of rejected guesses, freed)
            self.row_num_blocks[row] = num_blocks
        for item in items:
            if item.new is not None:
                self._reset_row(item.row, item.new)
            if item.new_block_ids:
                self._append_blocks(item.row, item.new_block_ids)
            if item.draft_token_ids:  # the guesses follow the input token (which may be pending)
                start = item.num_computed_tokens + 1
                self.token_buf[item.row, start: start + len(item.draft_token_ids)] = item.draft_token_ids
        decode_rows = np.array(out.decode_rows, np.int64)
        if out.decode_new_blocks:  # a decode row gains at most one block per step
            index, block_ids = zip(*out.decode_new_blocks)
            new_rows = decode_rows[list(index)]
            self.block_table[new_rows, self.row_num_blocks[new_rows]] = block_ids
            self.row_num_blocks[new_rows] += 1
        num_decode = len(decode_rows)
        if not items:  # decode only: one token per request
            counts = np.ones(num_decode, np.int64)
            starts = np.array(out.decode_positions, np.int64)
            return StepRows(decode_rows, starts, counts, np.arange(1, num_decode + 1), decode_rows, starts,
                            np.arange(num_decode), num_decode)
        rows = np.concatenate([decode_rows, np.array([item.row for item in items], np.int64)])
        starts = np.array(out.decode_positions + [item.num_computed_tokens for item in items], np.int64)
        counts = np.array([1] * num_decode + [item.num_new_tokens for item in items], np.int64)
        ends = np.cumsum(counts)
        req = np.repeat(np.arange(len(rows)), counts)  # token t belongs to request req[t]
        pos = np.arange(int(ends[-1])) - (ends - counts)[req] + starts[req]
        sample_index = np.concatenate([np.arange(num_decode),
                                       num_decode + np.flatnonzero([item.samples for item in items])])
        return StepRows(rows, starts, counts, ends, rows[req], pos, sample_index.astype(np.int64), num_decode)

    def fill_batch(self, layout: StepRows, t_pad: int, r_pad: int,
                   logits_rows: np.ndarray | None = None) -> tuple[ModelBatch, np.ndarray]:
        """The (T, R)-padded step arrays of `layout`, and prev_index [T]; `logits_rows`: the token indices
        scored (default: each sampling request's last token)."""
        num_tokens, num_reqs = layout.num_tokens, len(layout.rows)
        token_rows, pos = layout.token_rows, layout.pos
        token_ids = np.zeros(t_pad, np.int32)
        token_ids[:num_tokens] = self.token_buf[token_rows, pos]
        prev_index = np.full(t_pad, -1, np.int32)
        num_known = self.row_num_tokens[token_rows]
        pending = (pos >= num_known) & (pos < num_known + self.row_pending[token_rows])  # (not guesses)
        prev_index[:num_tokens][pending] = self.row_prev_index[token_rows[pending]]
        positions = np.zeros(t_pad, np.int32)
        positions[:num_tokens] = pos
        slots = np.zeros(t_pad, np.int32)  # padding tokens write into the null block 0
        bs = self.block_size
        slots[:num_tokens] = self.block_table[token_rows, pos // bs] * bs + pos % bs
        qsl = np.full(r_pad + 1, num_tokens, np.int32)
        qsl[0] = 0
        qsl[1: num_reqs + 1] = layout.ends
        seq_lens = np.zeros(r_pad, np.int32)
        seq_lens[:num_reqs] = layout.starts + layout.counts
        tables = np.zeros((r_pad, self.max_blocks), np.int32)
        tables[:num_reqs] = self.block_table[layout.rows]
        logits_idx = np.zeros(r_pad, np.int32)
        if logits_rows is None:
            logits_rows = layout.ends[layout.sample_index] - 1
        logits_idx[: len(logits_rows)] = logits_rows
        return ModelBatch(token_ids, positions, slots, qsl, seq_lens, tables, logits_idx), prev_index

    def prepare(self, out: SchedulerOutput) -> HostStep:
        """The host work of dispatching one step: row updates, the step's arrays, sampling metadata.

        prev_index[t] >= 0 marks a token sampled by the previous step and not yet on the host: the
        step reads it from that step's device output at that index.
        """
        layout = self.step_rows(out)
        items, rows, counts, num_decode = out.scheduled, layout.rows, layout.counts, layout.num_decode
        t_pad, r_pad = self.buckets.pad_tokens(layout.num_tokens), self.buckets.pad_requests(len(rows))
        decode_only = bool((counts == 1).all())  # one token each: token r is request r's (decode rows lead)
        prompt = None
        if items and self.row_prompt_logprobs[rows[num_decode:]].any():
            prompt = prompt_logprobs.gather(items, (layout.ends - counts)[num_decode:], self.row_prompt_logprobs,
                                            self.token_buf, self.row_num_prompt, self.row_generation,
                                            prompt_logprobs.num_rows(t_pad, self.max_prompt_logprob_rows))
            if prompt is not None:  # the variant: compiled for this T with its largest request bucket
                r_pad, decode_only = self._prompt_requests[t_pad], False
        sample_rows = rows[layout.sample_index]
        guesses = (spec_verify.step_guesses(out, layout, self.max_rows, self.row_prev_index,
                                            self.proposer.k if self.proposer is not None else 0)
                   if self.speculative else None)
        if guesses is not None:  # a logits row per position of a row with guesses
            r_pad = max(r_pad, self.buckets.pad_requests(len(guesses.logits_rows)))
        batch, prev_index = self.fill_batch(layout, t_pad, r_pad,
                                            guesses.logits_rows if guesses is not None else None)
        if out.deferred_decode:  # decode rows (token r: request r) whose position waits for the count of
            # guesses their verify step keeps: its token and count come from its device outputs (also when
            # it was collected already, before the scheduler took its update: the position is still none-kept)
            deferred = np.asarray(out.deferred_decode)
            prev_index[deferred] = self.row_prev_index[layout.rows[deferred]] + self.max_rows
        for k, item in enumerate(items):
            if item.device_guesses:  # its token and guesses: the previous step's token and drafts of the row
                start = int(layout.ends[num_decode + k] - counts[num_decode + k])
                kinds = 1 + np.arange(1 + item.device_guesses)
                prev_index[start: start + len(kinds)] = self.row_prev_index[item.row] + self.max_rows * kinds
        request_ids = out.decode_ids + [item.request_id for item in items if item.samples]
        if guesses is None:
            sampling = self._sampling_metadata(sample_rows, r_pad) if len(sample_rows) else None
        else:  # one logits row per position, each with its output token's metadata (spec_verify.py)
            sampling = self._sampling_metadata(sample_rows[guesses.row_of], r_pad, offsets=guesses.offsets)
        if self.speculative and self._last is not None and self._last.output is None and len(sample_rows):
            # Rows right behind their own verify step, in flight (deferred, device-guessed): their noise steps
            # count none of the guesses it keeps, and the sampler adds its kept count on device. (Collected,
            # the runner's counts hold it already.)
            behind = np.zeros(len(rows), bool)
            behind[out.deferred_decode] = True
            behind[num_decode + np.flatnonzero([item.device_guesses > 0 for item in items]).astype(np.int64)] = True
            step_from = np.where(behind[layout.sample_index], self.row_prev_index[sample_rows], -1)
            logits_of = guesses.row_of if guesses is not None else np.arange(len(sample_rows))
            sampling[0].step_from[: len(logits_of)] = step_from[logits_of]
        self.row_prev_index[sample_rows] = np.arange(len(sample_rows))
        self.row_pending[sample_rows] += 1
        return HostStep(batch, prev_index, sample_rows, self.row_generation[sample_rows], request_ids, sampling,
                        decode_only, prompt, guesses=guesses, layout=layout)

    def _sampling_metadata(self, rows: np.ndarray, r_pad: int, index: np.ndarray | None = None,
                           offsets: np.ndarray | None = None):
        """Sampling metadata of `r_pad` logits rows: row i of `rows` at index[i] (default: i). offsets[i]
        > 0: logits row i scores its request's output token offsets[i] places further, after as many of
        the guesses that step_rows wrote after its known tokens (their noise step, bans and history)."""
        offsets = np.zeros(len(rows), np.int64) if offsets is None else offsets
        num_output = self.row_num_tokens[rows] + self.row_pending[rows] - self.row_num_prompt[rows] + offsets
        use_penalties = bool(self.row_penalties[rows].any())
        history_len = self.max_model_len if use_penalties else 1
        md = sampler.empty_metadata(r_pad, MAX_BANNED, history_len)
        at = slice(0, len(rows)) if index is None else index
        src = self.sampling_rows
        for field in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "seeds"):
            getattr(md, field)[at] = getattr(src, field)[rows]
        md.steps[at] = num_output
        for i in np.flatnonzero(num_output < self.row_min_tokens[rows]):
            data = self.row_data[rows[i]]
            params = data.sampling_params
            banned = (list(data.eos_token_ids) if not params.ignore_eos else []) + list(params.stop_token_ids)
            md.banned_token_ids[i if index is None else index[i], : len(banned)] = banned
        if use_penalties:  # (dispatch collected the previous step first, so the history is complete)
            num_tokens = self.row_num_tokens[rows] + offsets
            md.token_history[at] = np.where(np.arange(history_len)[None, :] < num_tokens[:, None],
                                            self.token_buf[rows], -1)
            md.prompt_lens[at] = self.row_num_prompt[rows]
        all_greedy = bool(self.row_greedy[rows].all())
        num_logprobs = self.max_logprobs if self.row_logprobs[rows].any() else 0
        sort = not all_greedy and sampler.needs_sort(md, self.cfg.vocab_size)
        return md, all_greedy, use_penalties, num_logprobs, sort

    def dispatch(self, out: SchedulerOutput) -> StepHandle:
        """Enqueues one step on the device and starts copying its sampled tokens back; returns at once."""
        if self._last is not None and self._last.output is None:
            if self.row_penalties.any():
                rows = [item.row for item in out.scheduled if item.samples] + out.decode_rows
                if (self.row_pending[rows] * self.row_penalties[rows]).any():
                    self._collect(self._last)  # penalties read the whole history, the pending tokens included
            if out.deferred_decode and self._last.output is None:
                # A row behind its verify step samples its next output token: its min_tokens bans need the
                # count of guesses that step kept (its noise step takes it on device: prepare).
                rows = np.asarray(out.decode_rows)[out.deferred_decode]
                if self.row_min_tokens[rows].any():
                    self._collect(self._last)
        step = self.prepare(out)
        last = self._last
        prev_tokens = last.tokens if last is not None else self._zeros((self.max_rows,), jnp.int32)
        prev_accepted = last.num_accepted if last is not None and last.num_accepted is not None else self._no_accepted
        prev_drafts = last.drafts if last is not None and last.drafts is not None else self._no_drafts
        # A step that samples nothing marks its readiness with its logits: they must not be donated later.
        logits, greedy_tokens, *prompt_arrays = self._run_forward(
            step.batch, prev_tokens, step.prev_index, step.decode_only, keep_logits=step.sampling is not None,
            prompt=step.prompt, twins=step.decode_only or step.guesses is not None, prev_accepted=prev_accepted,
            prev_drafts=prev_drafts)
        prompt = None
        if step.prompt is not None:
            for array in prompt_arrays[0]:
                array.copy_to_host_async()
            prompt = (step.prompt.segments, prompt_arrays[0])
        if step.sampling is None:  # prefill chunks only: nothing to wait for, unless prompt logprobs come back
            handle = StepHandle(step.request_ids, step.rows, step.generations, prev_tokens, None, logits,
                                RunnerOutput([], []) if prompt is None else None, prompt, step.index)
        else:
            md, *variant = step.sampling
            all_greedy, use_penalties, num_logprobs, _ = variant
            if (greedy_tokens is not None and all_greedy and not use_penalties and not num_logprobs
                    and not (md.banned_token_ids >= 0).any()):
                result = sampler.SamplerOutput(greedy_tokens, None)  # the step's own argmax: no sampler launch
            else:
                compiled = self._compiled.get(("sample", logits.shape[0], *variant))
                shift = prev_accepted if self.speculative else None  # (md.step_from)
                result = (compiled(logits, md, shift) if compiled is not None
                          else self._sample(logits, md, shift, *variant))
            tokens, num_accepted = result.token_ids, None
            if step.guesses is not None:
                synthetic = (None if self.synthetic_acceptance is None else
                             spec_verify.synthetic_inputs(md, self.synthetic_acceptance, self.max_rows))
                tokens, num_accepted = spec_verify.run(self._compiled, result.token_ids, step.guesses, synthetic,
                                                       (prev_drafts, prev_accepted))
            tokens.copy_to_host_async()
            handle = StepHandle(step.request_ids, step.rows, step.generations, tokens, result.logprobs,
                                tokens, prompt=prompt, index=step.index, guesses=step.guesses,
                                num_accepted=num_accepted)
        if self.drafter is not None:
            handle.drafts = self.drafter.run(self, step, handle, prompt_arrays, prev_accepted)
        elif self.ngram is not None:
            handle.drafts = self.ngram.run(self, step, handle, prev_accepted)
        self._last = handle
        return handle

    def _run_forward(self, batch: ModelBatch, prev_tokens, prev_index, decode_only: bool = False,
                     keep_logits: bool = True, prompt: prompt_logprobs.PromptRows | None = None,
                     twins: bool = False, prev_accepted=None, prev_drafts=None):
        """Stage the step's inputs, run the forward -> (logits, greedy tokens of a decode-only step or
        None), plus prompt_logprobs.compute's arrays when `prompt` is given. Every device buffer the
        forward reads or writes is the same each time a shape recurs (staged inputs, caches, logits: all
        donated back in), so XLA launches its CUDA graph as recorded: updating a graph's nodes and
        re-uploading it would be most of a decode step's host time (benchmarks/RESULTS.md).
        `keep_logits=False`: the logits get a buffer of their own (nothing will donate it), for a step
        whose logits are its readiness marker. `twins`: a step that recurs back to back (decode-only
        steps, verify steps of speculative decoding) alternates between twin executables of its shape.
        `prev_accepted`: the previous step's accepted guesses per sampling row when it verified guesses
        (step_program._stage_step: rows right behind their verify step), else None; `prev_drafts`: its
        drafts [max_rows, k] with a drafter (device-guessed rows' guesses), else None."""
        t_pad, r_pad = batch.token_ids.shape[-1], batch.seq_lens.shape[-1]  # (per shard: [n, T] under EP)
        staged = self._staged.get((t_pad, r_pad))
        if staged is None:  # (precompile made those of every bucket)
            staged = self._zeros_like_batch(t_pad, r_pad)
        compiled = self._compiled.get(("stage", t_pad, r_pad))
        if compiled is not None:
            stage = compiled
        else:
            stage = functools.partial(self.stage_fn, block_size=self.stage_block_size)
        if prev_accepted is None:
            prev_accepted = self._no_accepted
        staged = self._staged[(t_pad, r_pad)] = stage(staged, pack_step(batch, prev_index), prev_tokens,
                                                      prev_accepted, prev_drafts)
        logits_buffer = self._logits.pop(r_pad, None) if keep_logits else None
        if logits_buffer is None:
            logits_buffer = zeros((r_pad * self.num_shards, self.cfg.vocab_size), jnp.float32, self.logits_sharding)
        # Decode and verify steps alternate between two executables of the step: with overlap the step in
        # flight still holds its temporary buffer when the next one starts, so one executable would see
        # its temporaries move every step (and XLA update all of its graph); each twin keeps its own.
        twin = False
        if twins and self.use_twins and prompt is None:
            twin = self._twin[(t_pad, r_pad, decode_only)] = not self._twin.get((t_pad, r_pad, decode_only), True)
        extra = self._expert_args()
        if prompt is not None:  # (the variant's own key: no twin, never decode_only)
            key = ("forward_prompt", t_pad, r_pad)
            extra["prompt"] = jax.device_put((prompt.indices, prompt.targets), self.on_device)  # one transfer
        else:
            key = ("forward", t_pad, r_pad, decode_only, twin)
        compiled = self._compiled.get(key)
        if compiled is not None:
            logits, self.kv_caches, tokens, *plp = compiled(self.model.params, staged, self.kv_caches,
                                                            logits_buffer, self.comm, **extra)
        else:
            logits, self.kv_caches, tokens, *plp = self.forward_fn(
                self.model.params, self.cfg, staged, self.kv_caches, logits_buffer, self.comm,
                attention_backend=self.attention_backend, tp=self.tp, decode_only=decode_only, twin=twin,
                flash_prefill_threshold=self.flash_prefill_threshold,
                out_rows=self.max_rows, num_prompt_logprobs=self.max_logprobs if prompt is not None else 0,
                **extra)
        if keep_logits:
            self._logits[r_pad] = logits
        if self.placement is not None:  # the expert-load accumulator (donated back) and its readable copy
            *plp, self.expert_load, self.step_expert_load = plp
            self.step_expert_load.copy_to_host_async()
        return (logits, tokens, *plp)

    def _expert_args(self) -> dict:
        """The forward's expert-parallel arguments (the placement tables and the expert-load accumulator;
        ep_runner.py), none without EP."""
        if self.placement is None:
            return {}
        return {"placement": self.placement, "expert_load": self.expert_load}

    def _sample(self, logits, md, prev_accepted, all_greedy: bool, use_penalties: bool, num_logprobs: int,
                sort: bool):
        return sampler.sample(logits, md, prev_accepted, all_greedy=all_greedy, use_penalties=use_penalties,
                              num_logprobs=num_logprobs, sort=sort, out_rows=self.max_rows,
                              tokens_sharding=self.tokens_sharding)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Waits for a dispatched step's sampled tokens; records them in the rows; returns them."""
        if handle.output is None:
            self._collect(handle)
        return handle.output

    def _collect(self, handle: StepHandle) -> None:
        rows = handle.rows
        index = np.arange(len(rows)) if handle.index is None else handle.index
        tokens = np.asarray(handle.tokens)[index] if len(rows) else np.zeros(0, np.int32)
        # A row reset since the dispatch (its request finished, or was preempted, and the row reused)
        # does not take the stale token; the scheduler drops it too.
        live = rows[self.row_generation[rows] == handle.generations]
        live_tokens = tokens[self.row_generation[rows] == handle.generations]
        num_accepted = device_guesses = None
        if handle.guesses is not None:  # accepted guesses go in before the sampled token
            if handle.guesses.device:  # a device-guessed row's: its previous step's drafts (collected before),
                # up to the first -1 (no guess there: never accepted)
                device_guesses = {i: spec_verify.cut_guesses(self.row_drafts.get(int(rows[i]), []), count)
                                  for i, count in handle.guesses.device.items()}
                handle.guesses.drafts.update(device_guesses)
            num_accepted = spec_verify.append_accepted(handle, self.token_buf, self.row_num_tokens,
                                                       self.row_generation)
        self.token_buf[live, self.row_num_tokens[live]] = live_tokens
        self.row_num_tokens[live] += 1
        self.row_pending[live] -= 1
        logprobs = guess_logprobs = None
        if handle.logprobs is not None:
            logprobs, guess_logprobs = spec_verify.read_logprobs(handle, index, num_accepted, self.row_data,
                                                                 self.cfg.vocab_size)
        prompt = None
        if handle.prompt is not None:
            prompt = prompt_logprobs.chunks(*handle.prompt, self.row_generation, self.row_data, self.cfg.vocab_size)
        drafts = draft_runner.DraftRunner.read(handle, len(rows))
        if drafts is not None:
            self.row_drafts.update(zip(live.tolist(), (d for d, ok in zip(drafts, self.row_generation[rows]
                                                                           == handle.generations) if ok)))
        handle.output = RunnerOutput(handle.request_ids, tokens.tolist(), logprobs, prompt, num_accepted,
                                     guess_logprobs, drafts, device_guesses)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One step without overlap: dispatch, then wait for its tokens."""
        return self.collect(self.dispatch(out))

    # ---- start-up ----
    def precompile(self, progress: bool = True) -> int:
        """Compiles every step shape ahead of time (runner/precompile.py); returns the number compiled."""
        from jaxserve.runner.precompile import precompile
        return precompile(self, progress)
