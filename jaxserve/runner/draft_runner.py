"""The draft model beside a ModelRunner (speculative.method draft_model): loading, its KV cache, and its
part of every step (the programs are in spec_decode/draft_model.py).

    ModelRunner.__init__  DraftRunner(config, tp, target config, max_model_len): checks and loads the
                          draft; block_bytes() joins the KV budget; init_caches(num_blocks) after it
    ModelRunner.dispatch  run(runner, step, handle) after the target's step is enqueued: fill the draft's
                          K/V over the step's staged batch; when the step samples, propose k drafts per
                          sampling row from its next token -> drafts [max_rows, k] (copying to the host)
    ModelRunner._collect  read(handle, num_rows) -> each sampling row's k drafts (RunnerOutput.draft_token_ids)

The draft runs on the target's devices: split over them as the target is (draft_tensor_parallel_size =
parallel.model), or whole on every one of them (1: its parameters and cache replicated).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.models import loader, registry
from jaxserve.runner.device_setup import kv_block_bytes, resolve_attention_backend
from jaxserve.spec_decode import draft_model
from sharding import TENSOR_PARALLEL, AxisRules, TensorParallel
from sharding.tensor_parallel import zeros

# Every logical axis whole on every device: a draft of tensor-parallel size 1 beside a sharded target.
REPLICATED = AxisRules(mapping=tuple((name, None) for name, _ in TENSOR_PARALLEL.mapping))


def draft_parallel(config: EngineConfig, tp: TensorParallel | None) -> TensorParallel | None:
    """The draft's TensorParallel on the target's mesh (None on a single device)."""
    size = config.speculative.draft_tensor_parallel_size or config.parallel.model
    if size not in (1, config.parallel.model):
        raise ValueError(f"speculative.draft_tensor_parallel_size={size}: the draft runs on the target's "
                         f"{config.parallel.model} device(s), split as the target ({config.parallel.model}) or "
                         f"whole on each (1); set one of those")
    if tp is None or tp.size == 1:
        return tp
    return tp if size == tp.size else dataclasses.replace(tp, rules=REPLICATED, all_reduce=None)


class DraftRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None, target, max_model_len: int):
        """Loads speculative.model as the draft of the `target` model config; ValueError when it cannot
        draft for it (another vocabulary, a shorter context)."""
        spec = config.speculative
        self.tp = draft_parallel(config, tp)
        try:
            cfg, _ = loader.load_config(spec.model, target.dtype)
        except loader.CheckpointError as err:
            raise ValueError(f"speculative.model: {err}") from None
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative.model {spec.model!r} has a vocabulary of {cfg.vocab_size} tokens but the "
                             f"target model's has {target.vocab_size}: a draft must share the target's tokenizer; "
                             f"choose a draft of the same family and vocabulary")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative.model {spec.model!r} takes {cfg.max_position_embeddings} positions but "
                             f"max_model_len is {max_model_len}; lower model.max_model_len or choose a draft with "
                             f"a longer context")
        self.model = loader.load_model(spec.model, dtype=target.dtype, tp=self.tp)
        self.cfg = cfg
        self.k = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.attention_backend = resolve_attention_backend(config.runner.attention_backend, cfg, self.block_size)
        self.kv_caches: list[jax.Array] = []

    def block_bytes(self) -> int:
        """Bytes of the draft's K/V per KV block on one device (added to the target's in the KV budget)."""
        return kv_block_bytes(self.cfg, self.block_size, np.dtype(self.cfg.jnp_dtype).itemsize, self.tp)

    def init_caches(self, num_blocks: int, max_rows: int, on_device) -> None:
        self.kv_caches = registry.family_of(self.cfg).init_kv_caches(self.cfg, num_blocks, self.block_size,
                                                                     self.attention_backend, tp=self.tp)
        self.on_device = on_device
        self._no_guesses = zeros((max_rows,), jnp.int32, on_device)  # num_accepted of a step without guesses

    def _static(self) -> dict:
        return dict(cfg=self.cfg, attention_backend=self.attention_backend, tp=self.tp)

    def rows(self, runner, step) -> np.ndarray:
        """[3, max_rows] int32 of a step's sampling rows (draft_model.propose's `rows`): the batch row of each,
        the position its next token takes when no guess is accepted, and its allocated slots (0: padding)."""
        batch, num_rows = step.batch, len(step.rows)
        if step.guesses is None:
            last = batch.logits_indices[:num_rows]
            num_guesses = np.zeros(num_rows, np.int64)
        else:  # a request's logits rows: its input position, then one per guess
            num_guesses = np.bincount(step.guesses.row_of, minlength=num_rows)[:num_rows] - 1
            last = step.guesses.logits_rows[step.guesses.first[:num_rows] + num_guesses]
        out = np.zeros((3, runner.max_rows), np.int32)
        out[0, :num_rows] = np.searchsorted(batch.query_start_loc, last, side="right") - 1
        out[1, :num_rows] = batch.positions[last] - num_guesses + 1
        out[2, :num_rows] = runner.row_num_blocks[step.rows] * self.block_size
        return out

    def run(self, runner, step, handle) -> jax.Array | None:
        """The draft's part of a dispatched step -> drafts [max_rows, k] int32 (copying to the host), or None
        when the step samples nothing."""
        t_pad, r_pad = step.batch.token_ids.shape[-1], step.batch.seq_lens.shape[-1]
        staged = runner._staged[(t_pad, r_pad)]
        fill = runner._compiled.get(("draft_fill", t_pad, r_pad))
        if fill is not None:
            self.kv_caches = fill(self.model.params, staged, self.kv_caches)
        else:
            self.kv_caches = draft_model.fill(self.model.params, staged, self.kv_caches, **self._static())
        if step.sampling is None:
            return None
        rows = jax.device_put(self.rows(runner, step), self.on_device)
        num_accepted = handle.num_accepted if handle.num_accepted is not None else self._no_guesses
        args = (self.model.params, staged.block_tables, self.kv_caches, handle.tokens, num_accepted, rows)
        propose = runner._compiled.get(("draft_propose", r_pad))
        if propose is not None:
            self.kv_caches, drafts = propose(*args)
        else:
            self.kv_caches, drafts = draft_model.propose(*args, k=self.k, block_size=self.block_size,
                                                         **self._static())
        drafts.copy_to_host_async()
        return drafts

    @staticmethod
    def read(handle, num_rows: int) -> list[list[int]] | None:
        """A collected step's drafts, per sampling row."""
        drafts = getattr(handle, "drafts", None)
        return None if drafts is None else np.asarray(drafts)[:num_rows].tolist()

    def precompile_jobs(self, runner) -> dict:
        """runner.precompile's jobs for the draft (their executables go into runner._compiled): a fill per
        step shape, and a propose per request bucket (the block tables it reads are the staged batch's)."""
        def device_batch(t_pad: int, r_pad: int):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=runner.batch_sharding),
                                runner._host_batch(t_pad, r_pad))

        def fill(t_pad: int, r_pad: int):
            return draft_model.fill.lower(self.model.params, device_batch(t_pad, r_pad), self.kv_caches,
                                          **self._static()).compile()

        def propose(r_pad: int):
            tokens = jax.ShapeDtypeStruct((runner.max_rows,), jnp.int32, sharding=self.on_device)
            rows = jax.ShapeDtypeStruct((3, runner.max_rows), jnp.int32, sharding=self.on_device)
            tables = device_batch(r_pad, r_pad).block_tables
            return draft_model.propose.lower(self.model.params, tables, self.kv_caches, tokens, tokens, rows,
                                             k=self.k, block_size=self.block_size, **self._static()).compile()

        jobs = {("draft_fill", t_pad, r_pad): (fill, (t_pad, r_pad)) for t_pad, r_pad in runner._step_shapes}
        jobs.update({("draft_propose", r_pad): (propose, (r_pad,)) for r_pad in {r for _, r in runner._step_shapes}})
        return jobs
