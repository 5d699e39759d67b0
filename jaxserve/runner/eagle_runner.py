"""The EAGLE head beside a ModelRunner (speculative.method eagle): DraftRunner's flow (draft_runner.py) with
the head's programs (models/eagle_head.py), which also read the target's hidden states of the step and the
target's embedding and lm head. Eagle3Runner (method eagle3) runs an EAGLE-3 head (models/eagle3_head.py) the
same way over the residual stream entering its aux layers (the target's forward returns them), with the
head's own lm head over its draft vocabulary.

The head is small: it runs whole on every device of the target's mesh (its parameters and one-layer KV
cache replicated), whatever draft_tensor_parallel_size says.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import eagle3_head as eagle3
from jaxserve.models import eagle_head as eagle
from jaxserve.models import loader
from jaxserve.runner.draft_runner import REPLICATED, DraftRunner


class EagleRunner(DraftRunner):
    needs_hidden = True
    joined = False
    fill_program, fill_propose_program = staticmethod(eagle.fill), staticmethod(eagle.fill_propose)

    @staticmethod
    def _parallel(config, tp):
        return None if tp is None or tp.size == 1 else dataclasses.replace(tp, rules=REPLICATED, all_reduce=None)

    def _load(self, path: str, target, max_model_len: int):
        if not eagle.fits_target(target):
            raise ValueError(f"speculative.method=eagle needs a Llama-family target (its embedding and lm head); "
                             f"this one is {target.architecture}")
        try:
            cfg = eagle.head_config(path, target.dtype)
        except (loader.CheckpointError, ValueError) as err:
            raise ValueError(f"speculative.model: {err}") from None
        if cfg.hidden_size != target.hidden_size:
            raise ValueError(f"speculative.model {path!r}: the EAGLE head's hidden_size is {cfg.hidden_size} but the "
                             f"target model's is {target.hidden_size}; use a head trained for this target")
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative.model {path!r}: the EAGLE head's vocabulary has {cfg.vocab_size} tokens but "
                             f"the target model's has {target.vocab_size}; use a head trained for this target")
        sharding = None if self.tp is None else self.tp.sharding(())
        try:
            params = eagle.load_head(path, cfg, lambda array: jax.device_put(array, sharding))
        except loader.CheckpointError as err:
            raise ValueError(f"speculative.model: {err}") from None
        return cfg, params

    def _propose_static(self) -> dict:
        return dict(self._static(), target_cfg=self.target, k=self.k, block_size=self.block_size)

    def next_tokens(self, runner, step) -> np.ndarray:
        """[T] int32 per token of the step, its next token for the fill (models/eagle_head.py): -1 the next in
        the batch, -2 none (a sampling request's last token, and padding), or a prefill chunk's next prompt
        token."""
        layout = step.layout
        out = np.full(step.batch.token_ids.shape[-1], -1, np.int32)
        out[layout.num_tokens:] = -2
        last = layout.ends - 1
        samples = np.zeros(len(layout.rows), bool)
        samples[layout.sample_index] = True
        out[last[samples]] = -2
        chunks = ~samples  # mid-prompt: the next token is a known prompt token
        out[last[chunks]] = runner.token_buf[layout.rows[chunks], layout.pos[last[chunks]] + 1]
        return out

    def _fill_args(self, runner, step, staged, hidden, num_accepted, rows) -> tuple:
        """The fill program's arguments (`step` None: abstract ones, for precompiling)."""
        if step is None:
            next_tokens = jax.ShapeDtypeStruct(staged.token_ids.shape, jnp.int32, sharding=self.on_device)
        else:
            next_tokens = self.next_tokens(runner, step)  # (copied in by the call)
        return (self.params, runner.model.params, staged, hidden, self.kv_caches, next_tokens, num_accepted, rows)


class Eagle3Runner(EagleRunner):
    fill_program, fill_propose_program = staticmethod(eagle3.fill), staticmethod(eagle3.fill_propose)

    def _load(self, path: str, target, max_model_len: int):
        """-> (the head's layer config, its params); self.head: its Eagle3Config, self.aux_layers the
        target layers it reads, in the order the target runs them."""
        if not eagle.fits_target(target):
            raise ValueError(f"speculative.method=eagle3 needs a Llama-family target (its residual stream and "
                             f"embedding); this one is {target.architecture}")
        try:
            head = eagle3.head_config(path, target.dtype, target.num_layers)
        except (loader.CheckpointError, ValueError) as err:
            raise ValueError(f"speculative.model: {err}") from None
        where = f"speculative.model {path!r}: the EAGLE-3 head's"
        for name, size in (("hidden_size", head.layer.hidden_size), ("target_hidden_size", head.target_hidden_size)):
            if size != target.hidden_size:
                raise ValueError(f"{where} {name} is {size} but the target model's hidden_size is "
                                 f"{target.hidden_size}; use a head trained for this target")
        if head.layer.vocab_size != target.vocab_size:
            raise ValueError(f"{where} vocab_size is {head.layer.vocab_size} but the target model's vocabulary has "
                             f"{target.vocab_size} tokens; use a head trained for this target")
        if not 1 <= head.draft_vocab_size <= target.vocab_size:
            raise ValueError(f"{where} draft_vocab_size is {head.draft_vocab_size}, larger than the target model's "
                             f"vocabulary ({target.vocab_size} tokens); use a head trained for this target")
        layers = head.aux_layers
        bad = [i for i in layers if not 0 <= i < target.num_layers]
        if bad or len(set(layers)) != len(layers):
            problem = (f"{bad} are not layers of the target model (0 .. {target.num_layers - 1})" if bad
                       else "name a layer twice")
            raise ValueError(f"{where} aux layers {list(layers)} (eagle_aux_hidden_state_layer_ids, default "
                             f"(2, L // 2, L - 3)) {problem}; set eagle_aux_hidden_state_layer_ids in its "
                             f"config.json to the layers it was trained on")
        sharding = None if self.tp is None else self.tp.sharding(())
        try:
            params = eagle3.load_head(path, head, lambda array: jax.device_put(array, sharding))
        except loader.CheckpointError as err:
            raise ValueError(f"speculative.model: {err}") from None
        self.head, self.aux_layers = head, tuple(sorted(layers))
        return head.layer, params

    def _static(self) -> dict:
        return dict(cfg=self.head, attention_backend=self.attention_backend, tp=self.tp)

    def _propose_static(self) -> dict:
        return dict(self._static(), k=self.k, block_size=self.block_size)
