"""SchedulerOutput -> padded device arrays -> jitted forward + sampler -> RunnerOutput.

    execute(out): drop state of finished ids; add state for new ones; for each scheduled request
      take its step tokens, positions and slots (block id * S + offset) -> ModelBatch padded to the
      (T, R) buckets -> forward(params, batch, kv_caches donated) -> logits of sampling rows
      -> sample(logits, SamplingMetadata) -> token ids read back -> RunnerOutput

Per-request state lives in fixed rows of preallocated numpy arrays (block tables, sampling
parameters), so a step gathers rows with one fancy index instead of rebuilding them.
Every jitted shape comes from core/buckets.py and all of them are compiled in `precompile()`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketLadders
from jaxserve.core.sched_types import Logprobs, NewRequestData, RunnerOutput, SchedulerOutput
from jaxserve.models import llama
from jaxserve.models.layers import ModelBatch
from jaxserve.models.loader import LoadedModel
from jaxserve.runner import sampler

logger = logging.getLogger(__name__)

MAX_BANNED = 16  # eos + stop token ids suppressed while a request is below min_tokens

# One jitted step for the process, so engines with the same model config and shapes share compilations.
_forward = jax.jit(llama.forward, static_argnames=("cfg", "attention_backend"), donate_argnames=("kv_caches",))


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache in a private (0700) directory. Its entries are trusted code."""
    if not directory:
        return
    path = Path(os.path.expanduser(directory))
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _pallas_supports(cfg: llama.LlamaConfig, block_size: int) -> bool:
    """Shapes the Pallas kernels take: Triton needs power-of-two head dims >= 16 and page sizes."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    return pow2(cfg.head_dim) and cfg.head_dim >= 16 and pow2(block_size)


def resolve_attention_backend(name: str, cfg: llama.LlamaConfig, block_size: int) -> str:
    """auto: the Pallas kernels on GPU and TPU when they take the model's shapes, else the reference."""
    if name == "auto":
        if jax.default_backend() not in ("gpu", "tpu"):
            return "reference"
        if not _pallas_supports(cfg, block_size):
            logger.warning("attention_backend auto: head_dim=%d / block_size=%d are not supported by the Pallas "
                           "kernels; using the reference attention", cfg.head_dim, block_size)
            return "reference"
        return "pallas"
    return name


def kv_cache_num_blocks(cfg: llama.LlamaConfig, config: EngineConfig, max_model_len: int, dtype_bytes: int) -> int:
    cache = config.cache
    per_block = cfg.num_layers * 2 * cache.block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif jax.default_backend() == "cpu":
        num_blocks = cache.cpu_num_blocks
    else:
        stats = jax.devices()[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        num_blocks = int(free * cache.memory_fraction) // per_block
    needed = math.ceil(max_model_len / cache.block_size) + 1  # + the null block
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks of {cache.block_size} tokens ({num_blocks * per_block / 2**30:.2f} "
            f"GiB) but one request of max_model_len={max_model_len} needs {needed} (with the null block); raise "
            f"cache.num_blocks or cache.memory_fraction, or lower model.max_model_len"
        )
    return num_blocks


@dataclasses.dataclass
class _RequestState:
    row: int  # this request's row in the runner's per-row arrays
    num_tokens: int  # tokens known: prompt + sampled so far (their ids live in token_buf[row])
    num_blocks: int
    data: NewRequestData

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.data.num_prompt_tokens


class ModelRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig, max_model_len: int):
        enable_compilation_cache(config.runner.compilation_cache_dir)
        self.model = model
        self.cfg = model.config
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.attention_backend = resolve_attention_backend(config.runner.attention_backend, self.cfg,
                                                           self.block_size)
        sched = config.scheduler
        self.buckets = BucketLadders.build(sched.max_num_batched_tokens, sched.max_num_seqs,
                                           config.runner.token_buckets, config.runner.request_buckets)
        self.max_blocks = math.ceil(max_model_len / self.block_size)
        dtype = self.cfg.jnp_dtype
        self.num_blocks = kv_cache_num_blocks(self.cfg, config, max_model_len, np.dtype(dtype).itemsize)
        self.kv_caches = llama.init_kv_caches(self.cfg, self.num_blocks, self.block_size, self.attention_backend)
        self.max_logprobs = min(sched.max_logprobs, self.cfg.vocab_size)

        # Per-row state, so a step gathers rows with fancy indexing instead of per-token Python.
        rows = sched.max_num_seqs
        self.token_buf = np.zeros((rows, max_model_len), np.int32)  # every known token id of a request
        self.block_table = np.zeros((rows, self.max_blocks), np.int32)
        self.sampling_rows = sampler.empty_metadata(rows, MAX_BANNED, 1)
        self.row_greedy = np.zeros(rows, bool)
        self.row_penalties = np.zeros(rows, bool)
        self.row_logprobs = np.zeros(rows, bool)
        self.row_min_tokens = np.zeros(rows, np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.states: dict[str, _RequestState] = {}

    # ---- per-request state ----
    def _add(self, request_id: str, data: NewRequestData) -> _RequestState:
        row = self.free_rows.pop()
        state = _RequestState(row, len(data.all_token_ids), 0, data)
        self.states[request_id] = state
        self.token_buf[row, : state.num_tokens] = data.all_token_ids
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
        self.row_min_tokens[row] = params.min_tokens
        return state

    def _drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_rows.append(state.row)

    # ---- one step ----
    def prepare(self, out: SchedulerOutput):
        """Host arrays for one step: (ModelBatch, sampling requests [(index, id, state)], padded R)."""
        for request_id in out.finished_request_ids:
            self._drop(request_id)
        states, block_table, scheduled = self.states, self.block_table, out.scheduled
        # NOTE: comprehensions, not one loop of appends: this runs for every request every step.
        step_states = [states.get(item.request_id) or self._add(item.request_id, item.new) for item in scheduled]
        for item, state in zip(scheduled, step_states):
            if item.new_block_ids:
                end = state.num_blocks + len(item.new_block_ids)
                block_table[state.row, state.num_blocks: end] = item.new_block_ids
                state.num_blocks = end
        rows = [state.row for state in step_states]
        starts = [item.num_computed_tokens for item in scheduled]
        counts = [item.num_new_tokens for item in scheduled]
        samplers = [(index, item.request_id, state) for index, (item, state) in enumerate(zip(scheduled, step_states))
                    if item.samples]

        num_reqs = len(rows)
        rows_arr = np.array(rows, np.int64)
        counts_arr = np.array(counts, np.int64)
        ends = np.cumsum(counts_arr)
        num_tokens = int(ends[-1])
        t_pad, r_pad = self.buckets.pad_tokens(num_tokens), self.buckets.pad_requests(num_reqs)
        # Token t belongs to request req[t] and sits at position pos[t] of that request.
        req = np.repeat(np.arange(num_reqs), counts_arr)
        pos = np.arange(num_tokens) - (ends - counts_arr)[req] + np.array(starts, np.int64)[req]
        token_rows = rows_arr[req]

        token_ids = np.zeros(t_pad, np.int32)
        token_ids[:num_tokens] = self.token_buf[token_rows, pos]
        positions = np.zeros(t_pad, np.int32)
        positions[:num_tokens] = pos
        slots = np.zeros(t_pad, np.int32)  # padding tokens write into the null block 0
        bs = self.block_size
        slots[:num_tokens] = block_table[token_rows, pos // bs] * bs + pos % bs
        qsl = np.full(r_pad + 1, num_tokens, np.int32)
        qsl[0] = 0
        qsl[1: num_reqs + 1] = ends
        seq_lens = np.zeros(r_pad, np.int32)
        seq_lens[:num_reqs] = np.array(starts, np.int64) + counts_arr
        tables = np.zeros((r_pad, self.max_blocks), np.int32)
        tables[:num_reqs] = block_table[rows_arr]
        logits_idx = np.zeros(r_pad, np.int32)
        if samplers:
            logits_idx[: len(samplers)] = ends[[index for index, _, _ in samplers]] - 1
        batch = ModelBatch(token_ids, positions, slots, qsl, seq_lens, tables, logits_idx)
        return batch, samplers, r_pad

    def _sampling_metadata(self, samplers, r_pad):
        rows = np.array([state.row for _, _, state in samplers], np.int64)
        num_tokens = np.array([state.num_tokens for _, _, state in samplers], np.int64)
        num_prompt = np.array([state.data.num_prompt_tokens for _, _, state in samplers], np.int64)
        use_penalties = bool(self.row_penalties[rows].any())
        history_len = self.max_model_len if use_penalties else 1
        md = sampler.empty_metadata(r_pad, MAX_BANNED, history_len)
        n = len(samplers)
        src = self.sampling_rows
        for field in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "seeds"):
            getattr(md, field)[:n] = getattr(src, field)[rows]
        md.steps[:n] = num_tokens - num_prompt
        for i in np.flatnonzero(num_tokens - num_prompt < self.row_min_tokens[rows]):
            data = samplers[i][2].data
            params = data.sampling_params
            banned = (list(data.eos_token_ids) if not params.ignore_eos else []) + list(params.stop_token_ids)
            md.banned_token_ids[i, : len(banned)] = banned
        if use_penalties:
            history = self.token_buf[rows]
            md.token_history[:n] = np.where(np.arange(history_len)[None, :] < num_tokens[:, None], history, -1)
            md.prompt_lens[:n] = num_prompt
        all_greedy = bool(self.row_greedy[rows].all())
        num_logprobs = self.max_logprobs if self.row_logprobs[rows].any() else 0
        return md, all_greedy, use_penalties, num_logprobs

    def record(self, samplers, tokens: np.ndarray, host_logprobs=None) -> RunnerOutput:
        """Append this step's sampled tokens to the per-request state and package the RunnerOutput."""
        states = [state for _, _, state in samplers]
        rows = np.fromiter((state.row for state in states), np.int64, len(states))
        positions = np.fromiter((state.num_tokens for state in states), np.int64, len(states))
        self.token_buf[rows, positions] = tokens
        for state in states:
            state.num_tokens += 1
        logprobs = None
        if host_logprobs is not None:
            lp, rank, top_ids, top_lps = host_logprobs
            logprobs = []
            for i, state in enumerate(states):
                wanted = state.data.sampling_params.logprobs
                logprobs.append(None if wanted is None else Logprobs(
                    float(lp[i]), int(rank[i]), top_ids[i, :wanted].tolist(), top_lps[i, :wanted].tolist()))
        return RunnerOutput([request_id for _, request_id, _ in samplers], tokens.tolist(), logprobs)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        batch, samplers, r_pad = self.prepare(out)
        logits, self.kv_caches = _forward(self.model.params, self.cfg, batch, self.kv_caches,
                                          attention_backend=self.attention_backend)
        if not samplers:
            return RunnerOutput([], [])
        md, all_greedy, use_penalties, num_logprobs = self._sampling_metadata(samplers, r_pad)
        result = sampler.sample(logits, md, all_greedy=all_greedy, use_penalties=use_penalties,
                                num_logprobs=num_logprobs)
        tokens = np.asarray(result.token_ids)[: len(samplers)]
        host_logprobs = jax.device_get(result.logprobs) if result.logprobs is not None else None
        return self.record(samplers, tokens, host_logprobs)

    # ---- start-up ----
    def precompile(self, progress: bool = True) -> int:
        """Compile every (T, R) forward bucket and every sampler variant; returns the number compiled."""
        plan = self.buckets.precompile_plan()
        variants = [(g, p, lp) for g in (True, False) for p in (False, True) for lp in (0, self.max_logprobs)]
        total = len(plan) + len(self.buckets.request_buckets) * len(variants)
        bar = tqdm(total=total, desc="compiling buckets", disable=not progress, leave=False)
        for t_pad, r_pad in plan:
            batch = ModelBatch(np.zeros(t_pad, np.int32), np.zeros(t_pad, np.int32), np.zeros(t_pad, np.int32),
                               np.zeros(r_pad + 1, np.int32), np.zeros(r_pad, np.int32),
                               np.zeros((r_pad, self.max_blocks), np.int32), np.zeros(r_pad, np.int32))
            logits, self.kv_caches = _forward(self.model.params, self.cfg, batch, self.kv_caches,
                                                   attention_backend=self.attention_backend)
            bar.update()
        for r_pad in self.buckets.request_buckets:
            for all_greedy, use_penalties, num_logprobs in variants:
                md = sampler.empty_metadata(r_pad, MAX_BANNED, self.max_model_len if use_penalties else 1)
                logits = jax.numpy.zeros((r_pad, self.cfg.vocab_size), jax.numpy.float32)
                jax.block_until_ready(sampler.sample(logits, md, all_greedy=all_greedy, use_penalties=use_penalties,
                                                     num_logprobs=num_logprobs))
                bar.update()
        jax.block_until_ready(self.kv_caches)
        bar.close()
        return total
