"""N-gram proposals on the device beside a ModelRunner (speculative.method ngram, one process): each
request's tokens in a device history, and after every step that samples, the next proposals of its
sampling rows from tokens the host may not have yet (spec_decode/ngram_device.py).

    ModelRunner.prepare   reset(row, tokens) for each request (re)starting: its known tokens uploaded
    ModelRunner.dispatch  run(runner, step, handle, prev_accepted) after the step's verification: the step's
                          input tokens and each sampling row's output token written into the history, then
                          the proposals -> drafts [max_rows, k] (-1: no guess), copying to the host
    ModelRunner.precompile  precompile_jobs(runner): a program per step shape, and the row upload

The drafts feed device-guessed rows (a row right behind its verify step takes them as its guesses, read on
device by the next step's staging); rows the host schedules otherwise keep the host's n-gram lookup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.runner import spec_verify
from jaxserve.spec_decode import ngram_device
from sharding.tensor_parallel import zeros


def make(config: EngineConfig, num_rows: int, max_model_len: int, max_rows: int, on_device,
         compiled: dict) -> NgramProposer | None:
    """The runner's n-gram proposer (speculative.method ngram in one process, without expert shards), else
    None (the host's lookup alone)."""
    if (config.speculative.method != "ngram" or config.parallel.num_processes != 1
            or config.parallel.expert != 1):
        return None
    return NgramProposer(config, num_rows, max_model_len, max_rows, on_device, compiled)


class NgramProposer:
    def __init__(self, config: EngineConfig, num_rows: int, max_model_len: int, max_rows: int, on_device,
                 compiled: dict):
        """`compiled`: the runner's table of executables (precompile_jobs' land there, by their keys)."""
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.lookup_range
        # the bench's synthetic acceptance accepts by chance, so every position needs a guess to accept
        self.fill = 0 if spec.synthetic_acceptance is not None else -1
        self.length = max_model_len
        self.max_rows = max_rows
        self.on_device = on_device
        self.history = zeros((num_rows, max_model_len), jnp.int32, on_device)
        self._compiled = compiled

    def _static(self) -> dict:
        return dict(k=self.k, min_n=self.min_n, max_n=self.max_n, fill=self.fill)

    def reset(self, row: int, tokens: list[int]) -> None:
        """A (re)starting request's known tokens into its row."""
        padded = np.zeros(self.length, np.int32)
        padded[:len(tokens)] = tokens[:self.length]
        row_index, padded = jax.device_put((np.asarray(row, np.int32), padded), self.on_device)
        self.history = (self._compiled.get(("ngram_set_row",)) or ngram_device.set_row)(self.history, row_index, padded)

    def _host_inputs(self, runner, step) -> np.ndarray:
        """request_rows [R], sample_rows [M], base [M] and moved_by [M] of a step, joined (ngram_device.step's
        `rows`): each batch request's row, each sampling row's row (-1 past them), the position its output
        token takes with no guess kept, and the previous step's sampling row that moves it (device-guessed
        rows; -1 for the others)."""
        batch, layout, num_rows = step.batch, step.layout, len(step.rows)
        request_rows = np.zeros(batch.seq_lens.shape[-1], np.int32)
        request_rows[:len(layout.rows)] = layout.rows
        sample_rows, base, moved_by = (np.full(self.max_rows, -1, np.int32) for _ in range(3))
        sample_rows[:num_rows] = step.rows
        first = spec_verify.input_tokens(batch, step.guesses, num_rows)
        if step.guesses is not None and step.guesses.device:
            moved_by = step.guesses.row_moved_by.astype(np.int32)
        base[:num_rows] = batch.positions[first] + 1
        return np.concatenate([request_rows, sample_rows, base, moved_by])

    def run(self, runner, step, handle, prev_accepted: jax.Array) -> jax.Array | None:
        """The proposer's part of a dispatched step -> drafts [max_rows, k] int32 (copying to the host), or
        None when the step samples nothing (a prompt chunk's tokens are in the history since its reset)."""
        if step.sampling is None:
            return None
        batch = step.batch
        t_pad, r_pad = batch.token_ids.shape[-1], batch.seq_lens.shape[-1]
        staged = runner._staged[(t_pad, r_pad)]
        rows = self._host_inputs(runner, step)  # (the call copies it in: less host time than a device_put)
        num_accepted = handle.num_accepted if handle.num_accepted is not None else runner._no_accepted
        args = (self.history, staged.token_ids, staged.positions, staged.query_start_loc, rows, prev_accepted,
                handle.tokens, num_accepted)
        compiled = self._compiled.get(("ngram_step", t_pad, r_pad))
        self.history, drafts = compiled(*args) if compiled is not None else ngram_device.step(*args, **self._static())
        drafts.copy_to_host_async()
        return drafts

    def precompile_jobs(self, runner) -> dict:
        """runner.precompile's jobs: the step's program per step shape, and the row upload."""
        rows = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=self.on_device)

        def abstract(shape, dtype=jnp.int32, sharding=None):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or runner.batch_sharding)

        def step_program(t_pad: int, r_pad: int):
            batch = runner._host_batch(t_pad, r_pad)
            inputs = jax.ShapeDtypeStruct((r_pad + 3 * self.max_rows,), jnp.int32, sharding=self.on_device)
            return ngram_device.step.lower(
                self.history, abstract(batch.token_ids.shape), abstract(batch.positions.shape),
                abstract(batch.query_start_loc.shape), inputs, rows, rows, rows, **self._static()).compile()

        def set_row_program():
            row = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.on_device)
            tokens = jax.ShapeDtypeStruct((self.length,), jnp.int32, sharding=self.on_device)
            return ngram_device.set_row.lower(self.history, row, tokens).compile()

        jobs = {("ngram_step", t_pad, r_pad): (step_program, (t_pad, r_pad)) for t_pad, r_pad in runner._step_shapes}
        jobs[("ngram_set_row",)] = (set_row_program, ())
        return jobs
