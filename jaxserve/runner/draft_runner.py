"""A draft model beside a ModelRunner (speculative.method draft_model; eagle_runner.py for eagle): loading,
its KV cache, and its part of every step (the programs are in spec_decode/draft_model.py).

    ModelRunner.__init__  make(config, tp, target config, max_model_len): checks and loads the draft;
                          memory() joins the KV budget; init_caches(num_blocks, ...) after it
    ModelRunner.dispatch  run(runner, step, handle, forward outputs) after the target's step (forward,
                          sampler, verification) is enqueued: fill the draft's K/V over the step's staged
                          batch and propose k drafts per sampling row from its next token (one program,
                          draft_model.fill_propose) -> drafts [max_rows, k] (zero past the step's request
                          bucket), copying to the host with the step's tokens, when the step samples
    ModelRunner._collect  read(handle, num_rows) -> each sampling row's k drafts (RunnerOutput.draft_token_ids)
    ModelRunner.precompile  precompile_jobs(runner): a fill_propose per step shape (EAGLE heads: a fill and
                          a fill_propose per step shape); on a GPU each fill_propose twice, as twin
                          executables that the steps alternate between (the target step's reason:
                          ModelRunner._run_forward)

The draft runs on the target's devices: split over them as the target is (draft_tensor_parallel_size =
parallel.model), or whole on every one of them (1: its parameters and cache replicated).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.models import loader, registry
from jaxserve.runner import spec_verify
from jaxserve.runner.device_setup import (hold_fp8_transposed, holds_fp8_transposed, kv_block_bytes,
                                         resolve_attention_backend)
from jaxserve.runner.step_program import gpu_compiler_options
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


def make(config: EngineConfig, tp: TensorParallel | None, target, max_model_len: int) -> DraftRunner | None:
    """The proposer runner of speculative.method (None for a method without a model)."""
    if config.speculative.method == "draft_model":
        return DraftRunner(config, tp, target, max_model_len)
    if config.speculative.method == "eagle":
        from jaxserve.runner.eagle_runner import EagleRunner
        return EagleRunner(config, tp, target, max_model_len)
    if config.speculative.method == "eagle3":
        from jaxserve.runner.eagle_runner import Eagle3Runner
        return Eagle3Runner(config, tp, target, max_model_len)
    return None


def _moved_rows(rows: jax.Array, moved_by: jax.Array, prev_accepted: jax.Array) -> jax.Array:
    """DraftRunner.rows with device-guessed rows' positions moved by the count their previous step kept
    (moved_by [M]: that step's sampling row, -1 for the others)."""
    return rows.at[1].add(jnp.where(moved_by >= 0, prev_accepted[jnp.maximum(moved_by, 0)], 0))


moved_rows = jax.jit(_moved_rows)


class DraftRunner:
    """The draft model's state and its part of each step; eagle_runner.EagleRunner is the EAGLE head's,
    overriding what differs (loading, the programs and their arguments)."""

    needs_hidden = False  # the step's target hidden states are an input (ModelRunner's forward returns them)
    aux_layers: tuple[int, ...] = ()  # ... and then, when set, the residual stream entering these target layers
    # A draft model runs one program every step (draft_model.fill_propose: the fill's forward also gives the
    # first guess). The EAGLE heads (`joined` False) run their fill alone in a step that samples nothing and
    # their fill then propose as one program in one that samples (their fill reads the target's hidden states
    # and gives propose its first features): they set the two programs here and define _fill_args.
    joined = True
    fill_program = fill_propose_program = None

    def __init__(self, config: EngineConfig, tp: TensorParallel | None, target, max_model_len: int):
        """Loads speculative.model to guess for the `target` model config; ValueError when it cannot."""
        self.tp = self._parallel(config, tp)
        self.k = config.speculative.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.target = target
        self.load_format = config.model.load_format
        self.quantization = config.speculative.quantization
        self.cfg, self.params = self._load(config.speculative.model, target, max_model_len)
        self.attention_backend = resolve_attention_backend(config.runner.attention_backend, self.cfg, self.block_size)
        self.kv_caches: list[jax.Array] = []
        self._twin: dict[tuple[int, int], bool] = {}  # the twin the last fill_propose of a (T, R) ran
        self._first_use = None  # _fill_propose_on_first_use's program

    @staticmethod
    def _parallel(config: EngineConfig, tp: TensorParallel | None) -> TensorParallel | None:
        return draft_parallel(config, tp)

    def _load(self, path: str, target, max_model_len: int):
        """-> (the draft's model config, its params placed on self.tp's mesh, FP8 weights (an FP8 checkpoint's,
        or speculative.quantization fp8's) held [N, K] where device_setup.holds_fp8_transposed says so). With
        model.load_format dummy (benchmarks) the draft's weights are random too, from its config.json alone."""
        try:
            cfg, _ = loader.load_config(path, target.dtype, self.quantization)
        except (loader.CheckpointError, registry.UnsupportedModelError) as err:
            raise ValueError(f"speculative.model: {err}") from None
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative.model {path!r} has a vocabulary of {cfg.vocab_size} tokens but the "
                             f"target model's has {target.vocab_size}: a draft must share the target's tokenizer; "
                             f"choose a draft of the same family and vocabulary")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative.model {path!r} takes {cfg.max_position_embeddings} positions but "
                             f"max_model_len is {max_model_len}; lower model.max_model_len or choose a draft with "
                             f"a longer context")
        params = loader.load_model(path, dtype=target.dtype, load_format=self.load_format, tp=self.tp,
                                   quantization=self.quantization).params
        return cfg, hold_fp8_transposed(params) if holds_fp8_transposed(cfg, self.tp) else params

    def memory(self, buckets) -> tuple[int, int]:
        """(bytes of the draft's step outputs and temporaries at the largest shapes, bytes of its K/V per KV
        block on one device): what the KV budget sets aside besides the target's. The step's: float32 logits
        of the fill and of a propose step (R rows each), and the target's hidden states [T, D] when read."""
        rows, tokens = buckets.request_buckets[-1], max(buckets.token_buckets)
        hidden = tokens * self.feature_width * np.dtype(self.target.jnp_dtype).itemsize if self.needs_hidden else 0
        per_block = kv_block_bytes(self.cfg, self.block_size, np.dtype(self.cfg.jnp_dtype).itemsize, self.tp)
        return 2 * 4 * rows * self.target.vocab_size + hidden, per_block

    @property
    def feature_width(self) -> int:
        """The width of the target's hidden states the draft reads per token (needs_hidden)."""
        return self.target.hidden_size * max(1, len(self.aux_layers))

    def init_caches(self, num_blocks: int, max_rows: int, on_device) -> None:
        self.kv_caches = registry.family_of(self.cfg).init_kv_caches(self.cfg, num_blocks, self.block_size,
                                                                     self.attention_backend, tp=self.tp)
        self.on_device = on_device
        self._no_guesses = zeros((max_rows,), jnp.int32, on_device)  # num_accepted of a step without guesses
        self._no_rows = zeros((4, max_rows), jnp.int32, on_device)  # `rows` of a step that samples nothing

    def _static(self) -> dict:
        return dict(cfg=self.cfg, attention_backend=self.attention_backend, tp=self.tp)

    def _propose_static(self) -> dict:
        return dict(self._static(), k=self.k, block_size=self.block_size)

    def rows(self, runner, step) -> np.ndarray:
        """[4, max_rows] int32 of a step's sampling rows (the propose programs' `rows`): the batch row of each,
        the position after its input token (its next token's when no guess is accepted), its allocated slots
        (0: padding), and its input token's index in the step's tokens."""
        batch, num_rows = step.batch, len(step.rows)
        first = spec_verify.input_tokens(batch, step.guesses, num_rows)
        out = np.zeros((4, runner.max_rows), np.int32)
        out[0, :num_rows] = np.searchsorted(batch.query_start_loc, first, side="right") - 1
        out[1, :num_rows] = batch.positions[first] + 1
        out[2, :num_rows] = runner.row_num_blocks[step.rows] * self.block_size
        out[3, :num_rows] = first
        return out

    def run(self, runner, step, handle, forward_outputs: list, prev_accepted: jax.Array) -> jax.Array | None:
        """The draft's part of a dispatched step (`forward_outputs`: the target forward's outputs after its
        logits and tokens, the hidden states [T, D] last when needs_hidden) -> drafts [max_rows, k] int32 (copying
        to the host), or None when the step samples nothing."""
        hidden = forward_outputs[-1] if self.needs_hidden else None
        t_pad, r_pad = step.batch.token_ids.shape[-1], step.batch.seq_lens.shape[-1]
        staged = runner._staged[(t_pad, r_pad)]
        sampling = step.sampling is not None
        # Host arrays go into the calls as they are (a call copies them in for less host time than a device_put).
        rows = self.rows(runner, step) if sampling else self._no_rows
        if sampling and step.guesses is not None and step.guesses.device:  # positions moved on device
            rows = (runner._compiled.get(("draft_moved_rows",)) or moved_rows)(rows, step.guesses.row_moved_by,
                                                                               prev_accepted)
        num_accepted = handle.num_accepted if handle.num_accepted is not None else self._no_guesses
        program = None
        if self.joined or sampling:  # fill_propose, alternating between its twins where they exist
            twin = self._twin[(t_pad, r_pad)] = runner.use_twins and not self._twin.get((t_pad, r_pad), True)
            program = runner._compiled.get(("draft_fill_propose", t_pad, r_pad, twin))
        if self.joined:
            tokens = handle.tokens if sampling else self._no_guesses
            args = (self.params, staged, self.kv_caches, tokens, num_accepted, rows)
            self.kv_caches, drafts = (program or self._fill_propose_on_first_use(runner))(*args)
        else:
            args = self._fill_args(runner, step, staged, hidden, num_accepted, rows)
            if not sampling:
                fill = runner._compiled.get(("draft_fill", t_pad, r_pad))
                self.kv_caches, _ = fill(*args) if fill is not None else self.fill_program(*args, **self._static())
                return None
            self.kv_caches, drafts = (program(*args, handle.tokens) if program is not None
                                      else self.fill_propose_program(*args, handle.tokens, **self._propose_static()))
        if not sampling:
            return None
        drafts.copy_to_host_async()
        return drafts

    def _fill_propose_on_first_use(self, runner):
        """fill_propose where precompile made no executable: jitted once with the options precompile gives it,
        compiling each step shape on first use."""
        if self._first_use is None:
            options = tuple(sorted(self._compiler_options(runner).items()))
            self._first_use = functools.partial(draft_model.fill_propose_with(options), **self._propose_static())
        return self._first_use

    def _compiler_options(self, runner, twin: bool = False) -> dict:
        """The draft programs' XLA compiler options: the target step's GPU options (those of FP8 weights for
        an FP8 draft) where XLA:GPU compiles (runner.use_twins), else none."""
        fp8_weights = getattr(self.cfg, "quantization", None) is not None
        return gpu_compiler_options(fp8_weights, twin) if runner.use_twins else {}

    @staticmethod
    def read(handle, num_rows: int) -> list[list[int]] | None:
        """A collected step's drafts, per sampling row."""
        drafts = getattr(handle, "drafts", None)
        return None if drafts is None else np.asarray(drafts)[:num_rows].tolist()

    def precompile_jobs(self, runner) -> dict:
        """runner.precompile's jobs for the draft (their executables go into runner._compiled): a joined
        fill_propose per step shape (EAGLE heads: a fill and a fill_propose per step shape). A job returns
        {key: executable}: on a GPU fill_propose's twins ("draft_fill_propose", T, R, twin False and True),
        compiled with the target step's options (step_program.gpu_compiler_options) of the draft's weights."""
        def build(lowered, twin: bool = False):
            return lowered.compile(self._compiler_options(runner, twin) or None)

        def abstract(shape, dtype=jnp.int32, sharding=runner.batch_sharding):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        def inputs(t_pad: int, r_pad: int):  # (staged batch, target hidden states) of a step shape
            batch = jax.tree.map(lambda a: abstract(a.shape, a.dtype), runner._host_batch(t_pad, r_pad))
            return batch, abstract((t_pad, self.feature_width), self.target.jnp_dtype, self.on_device)

        tokens = abstract((runner.max_rows,), sharding=self.on_device)
        rows = abstract((4, runner.max_rows), sharding=self.on_device)

        def fill(t_pad: int, r_pad: int):
            args = self._fill_args(runner, None, *inputs(t_pad, r_pad), tokens, rows)
            return {("draft_fill", t_pad, r_pad): build(self.fill_program.lower(*args, **self._static()))}

        def fill_propose(t_pad: int, r_pad: int):
            if self.joined:
                args = (self.params, inputs(t_pad, r_pad)[0], self.kv_caches, tokens, tokens, rows)
                lowered = draft_model.fill_propose.lower(*args, **self._propose_static())
            else:
                args = (*self._fill_args(runner, None, *inputs(t_pad, r_pad), tokens, rows), tokens)
                lowered = self.fill_propose_program.lower(*args, **self._propose_static())
            twins = (False, True) if runner.use_twins else (False,)
            return {("draft_fill_propose", t_pad, r_pad, twin): build(lowered, twin) for twin in twins}

        moved = ("draft_moved_rows",)
        jobs = {moved: (lambda: {moved: moved_rows.lower(rows, tokens, tokens).compile()}, ())}
        for t_pad, r_pad in runner._step_shapes:
            jobs[("draft_fill_propose", t_pad, r_pad)] = (fill_propose, (t_pad, r_pad))
            if not self.joined:
                jobs[("draft_fill", t_pad, r_pad)] = (fill, (t_pad, r_pad))
        return jobs
