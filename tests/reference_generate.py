"""The simplest correct driver of `forward` over a paged KV cache: a greedy loop with no scheduler.

It is the oracle the engine and the parity tests lean on, so it stays plain: every step, each
unfinished request contributes its next prompt chunk (chunked prefill) or its one decode token
(mixed batches), block ids come from an optionally shuffled list (non-contiguous pages), and
logits are returned for every position processed so tests can compare them with HF's. Every step
is padded to the same width (the widest step the run can take), so a run compiles one program.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxserve.models import llama
from jaxserve.models.layers import ModelBatch

_step = jax.jit(llama.forward, static_argnames=("cfg", "attention_backend"), donate_argnames=("kv_caches",))


@dataclasses.dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated tokens per prompt (eos included when hit)
    logits: list[np.ndarray]  # [positions processed, V] float32 per prompt: prompt rows then decode rows


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def step_width(prompts: list[list[int]], chunk: int) -> int:
    """The token count every step is padded to: a power of two covering the widest step, in which each
    request feeds its first chunk (or, once its prompt is in, one decode token)."""
    return _pow2(sum(max(1, min(chunk, len(p))) for p in prompts))


def greedy_generate(
    params: llama.Params,
    cfg: llama.LlamaConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    chunk_size: int | None = None,
    shuffle_seed: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
    attention_backend: str = "reference",
    keep_logits: bool = True,
    kv_cache_dtype=None,
) -> GreedyResult:
    """`kv_cache_dtype`: the caches' dtype (None: the model's; float8_e4m3fn: an fp8 cache, scales 1)."""
    num_reqs = len(prompts)
    blocks_per_req = [math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts]
    max_blocks = max(blocks_per_req)
    block_ids = np.arange(1, 1 + sum(blocks_per_req) + 3)  # a few spare pages nobody owns
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(block_ids)
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    offset = 0
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = block_ids[offset: offset + n]
        offset += n
    kv_caches = llama.init_kv_caches(cfg, len(block_ids) + 1, block_size, attention_backend, dtype=kv_cache_dtype)

    tokens = [list(p) for p in prompts]
    num_computed = [0] * num_reqs
    generated: list[list[int]] = [[] for _ in prompts]
    logits_rows: list[list[np.ndarray]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * num_reqs
    chunk = chunk_size or max(len(p) for p in prompts)
    width = step_width(prompts, chunk)
    while not all(done):
        ids, pos, slots, spans = [], [], [], []
        seq_lens = np.zeros(num_reqs, np.int32)
        query_start_loc = np.zeros(num_reqs + 1, np.int32)
        for r in range(num_reqs):
            n = 0 if done[r] else min(chunk, len(tokens[r]) - num_computed[r])
            span = range(num_computed[r], num_computed[r] + n)
            ids += tokens[r][span.start: span.stop]
            pos += list(span)
            slots += [int(block_tables[r, p // block_size]) * block_size + p % block_size for p in span]
            spans.append((len(ids) - n, n))
            seq_lens[r] = span.stop if n else 0
            query_start_loc[r + 1] = len(ids)
        pad = width - len(ids)
        batch = ModelBatch(
            token_ids=np.array(ids + [0] * pad, np.int32),
            positions=np.array(pos + [0] * pad, np.int32),
            slot_mapping=np.array(slots + [0] * pad, np.int32),  # padding writes into the null block
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            logits_indices=np.arange(len(ids) + pad, dtype=np.int32),
        )
        logits, kv_caches = _step(params, cfg, batch, kv_caches, attention_backend=attention_backend)
        logits = np.asarray(logits)
        for r, (start, n) in enumerate(spans):
            if n == 0:
                continue
            if keep_logits:
                logits_rows[r].append(logits[start: start + n])
            num_computed[r] += n
            if num_computed[r] == len(tokens[r]):
                token = int(np.argmax(logits[start + n - 1]))
                generated[r].append(token)
                tokens[r].append(token)
                if len(generated[r]) >= max_new_tokens or token in eos_token_ids:
                    done[r] = True
    return GreedyResult(generated, [np.concatenate(rows) if rows else np.zeros((0, cfg.vocab_size), np.float32)
                                    for rows in logits_rows])
