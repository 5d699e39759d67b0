"""The engine config's `speculative` section (jaxserve/config.py holds the others and the loading): the
section's fields and checks, and vLLM's `speculative_config` dict mapped onto it."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config_types import check_fields, check_type

# Speculative-decoding methods vLLM has that jaxserve does not implement (yet).
SPECULATIVE_NOT_SUPPORTED = ("medusa", "mlp_speculator", "mtp", "suffix")
# Methods whose guesses come from a second network run on the device beside the target (`model`).
SPECULATIVE_MODEL_METHODS = ("draft_model", "eagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (off unless `method` is set): each step a request's next tokens are guessed and
    the model scores the guesses and one more position in the same step; greedy outputs are unchanged.
    ngram: guesses copied on the host from the request's own earlier tokens (prompt lookup,
    spec_decode/ngram.py). draft_model: a smaller model of the same vocabulary (`model`) guesses greedily
    on the device, with its own KV cache in the target's block tables (runner/draft_runner.py). eagle: a
    one-layer head (`model`) over the target's hidden states guesses the same way; eagle3: an EAGLE-3 head
    over the residual stream entering a few of the target's layers (models/eagle3_head.py)."""

    method: str | None = None  # null: off | ngram | draft_model | eagle | eagle3
    model: str | None = None  # draft_model: the draft checkpoint's directory; eagle, eagle3: the head's
    num_speculative_tokens: int | None = None  # k: tokens guessed per request per step (required with a method)
    # n-gram lengths matched against the request's tokens, longest first; one given: the other equals it;
    # neither: both 5 (vLLM's defaults).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model / eagle / eagle3: the draft's tensor-parallel size, 1 (every device runs the whole draft) or
    # parallel.model (split as the target is); null: parallel.model.
    draft_tensor_parallel_size: int | None = None
    # draft_model: fp8 quantizes a float draft checkpoint's dense weights at load, as model.quantization does
    # the target's (vLLM's speculative_config "quantization"); an FP8 draft checkpoint loads as FP8 either way.
    quantization: str | None = None
    # Bench only (`jaxserve bench --spec-synthetic-acceptance`; Engine refuses it elsewhere): every decode
    # row carries k guesses and each is accepted with this probability while the ones before it were
    # (runner/spec_verify.py), whatever the model says, so outputs are not meaningful.
    synthetic_acceptance: float | None = None

    def __post_init__(self):
        check_fields(self, "speculative")
        if self.synthetic_acceptance is not None:
            if self.method is None:
                raise ValueError("speculative.synthetic_acceptance needs a speculative method (e.g. ngram)")
            if not 0.0 <= self.synthetic_acceptance <= 1.0:
                raise ValueError(f"speculative.synthetic_acceptance must be in [0, 1], "
                                 f"got {self.synthetic_acceptance}")
        if self.method is None:
            set_fields = [name for name in ("model", "num_speculative_tokens", "prompt_lookup_min",
                                            "prompt_lookup_max", "draft_tensor_parallel_size", "quantization")
                          if getattr(self, name) is not None]
            if set_fields:
                raise ValueError(f"speculative.{set_fields[0]} is set but speculative.method is not; set "
                                 f"method (ngram, draft_model, eagle or eagle3) to speculate, or leave "
                                 f"{', '.join(set_fields)} unset")
            return
        if self.method in SPECULATIVE_NOT_SUPPORTED:
            raise ValueError(f"speculative.method={self.method!r} is not supported yet; use 'ngram' (prompt "
                             f"lookup), 'draft_model', 'eagle' or 'eagle3', or leave method unset")
        if self.method not in ("ngram", *SPECULATIVE_MODEL_METHODS):
            raise ValueError(f"speculative.method must be ngram, draft_model, eagle or eagle3 (or null: off), got "
                             f"{self.method!r}")
        if self.num_speculative_tokens is None or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative.num_speculative_tokens must be an integer >= 1 with method "
                             f"{self.method}, got {self.num_speculative_tokens!r}")
        if self.quantization is not None:
            if self.quantization != "fp8":
                raise ValueError(f"speculative.quantization={self.quantization!r} is not supported; use fp8 (an "
                                 f"FP8 draft model) or leave it unset")
            if self.method != "draft_model":
                raise ValueError(f"speculative.quantization is for method draft_model (the draft's weights); "
                                 f"method {self.method} has no draft checkpoint to quantize: leave it unset")
        if self.method == "ngram":
            misplaced = [name for name in ("model", "draft_tensor_parallel_size") if getattr(self, name) is not None]
            if misplaced:
                raise ValueError(f"speculative.{misplaced[0]} is for method draft_model, eagle or eagle3; method "
                                 f"ngram guesses without a model: leave it unset")
            low, high = self.lookup_range
            if not 1 <= low <= high:
                raise ValueError(f"speculative.prompt_lookup_min ({low}) and prompt_lookup_max ({high}) must "
                                 f"satisfy 1 <= prompt_lookup_min <= prompt_lookup_max")
            return
        if not self.model:
            raise ValueError(f"speculative.method={self.method!r} needs speculative.model: the directory of the "
                             f"{'draft checkpoint' if self.method == 'draft_model' else 'EAGLE head'}")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"speculative.prompt_lookup_min / prompt_lookup_max are for method ngram; leave "
                             f"them unset with method {self.method}")
        if self.draft_tensor_parallel_size is not None and self.draft_tensor_parallel_size < 1:
            raise ValueError(f"speculative.draft_tensor_parallel_size must be >= 1 (1 or parallel.model), got "
                             f"{self.draft_tensor_parallel_size}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def uses_model(self) -> bool:
        """Guesses come from a network on the device (draft_model, eagle, eagle3), made during each step."""
        return self.method in SPECULATIVE_MODEL_METHODS

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(min_n, max_n) of the n-gram match, the unset bounds resolved (the fields keep what was given, so
        a later override of one bound resolves afresh)."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        return (high if low is None else low), (low if high is None else high)


def speculative_from_vllm(value: Any) -> dict[str, Any]:
    """vLLM's `speculative_config` dict (or None: off) -> the speculative section's values. As in vLLM, a
    `model` without a `method` is a draft model."""
    check_type("speculative_config", value, dict | None)
    if value is None:
        return {}
    value = dict(value)
    if value.get("model") is not None and value.get("method") is None:
        value["method"] = "draft_model"
    known = {field.name for field in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown or unsupported key(s) {unknown}; known: {sorted(known)}")
    return value
