"""Per-request sampling parameters, with vLLM's field names, defaults, order and validation.

    user kwargs ──► SamplingParams.__post_init__ (normalise, validate: ValueError naming the parameter and value)
                ──► verify_against_engine(max_n=, max_logprobs=, vocab_size=)   (engine limits, before queueing)
                ──► scheduler / sampler / OutputStream read the fields

Everything a request alone can get wrong is checked here, so a bad request fails before it is queued or fanned
out into `n` sequences. Limits that depend on the engine (n cap, logprobs cap, vocabulary) are checked by
`verify_against_engine`; those that depend on the prompt (max_model_len) by the engine.

After __post_init__: `stop` and `stop_token_ids` are lists; ints and floats are plain Python ints and floats;
seed=-1 is None; top_k=-1 is 0; greedy requests (temperature 0) have top_p=1, top_k=0, min_p=0, as in vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import numbers

__all__ = ["SamplingParams"]

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM)
_MIN_TEMPERATURE = 1e-2  # tiny positive temperatures are raised to this (vLLM's _MAX_TEMP)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_BOOL_FIELDS = ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output")


def _as_int(name: str, value: object) -> int:
    # NOTE: bool is an int in Python, but top_k=True is always a client mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's `SamplingParams`, same names, defaults and order)."""

    n: int = 1  # sequences to return for the prompt
    presence_penalty: float = 0.0  # [-2, 2]; > 0 favours tokens not yet generated
    frequency_penalty: float = 0.0  # [-2, 2]; > 0 penalises tokens by their count in the output
    repetition_penalty: float = 1.0  # > 0; > 1 penalises tokens seen in prompt or output
    temperature: float = 1.0  # >= 0; 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 (or -1) = disabled
    min_p: float = 0.0  # [0, 1], relative to the most likely token's probability
    seed: int | None = None  # None (or -1) = unseeded
    stop: str | list[str] | None = None  # strings that end generation; not in the text unless include_stop_str
    stop_token_ids: list[int] | None = None  # token ids that end generation
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = as many as fit in max_model_len (resolved by the engine)
    min_tokens: int = 0  # eos / stop_token_ids / stop strings are not honoured before this many tokens
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one); -1 = all; None = off
    # per prompt token (the first has none): its logprob and rank, plus the top-N; -1 = all; None = off
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._normalise()
        self._verify()
        if self.is_greedy:
            # As vLLM: the filters are meaningless for argmax, so the sampler never sees them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got n={self.n}")

    def _normalise(self) -> None:
        if self.logprobs is True:  # vLLM maps logprobs=True to 1
            self.logprobs = 1
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in _INT_FIELDS:
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in _OPTIONAL_INT_FIELDS:
            if (value := getattr(self, name)) is not None:
                setattr(self, name, _as_int(name, value))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which may cause numerical errors (nan or inf); "
                           "raised to %s", self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            ids = [_as_int("stop_token_ids", t) for t in self.stop_token_ids]
            self.stop_token_ids = list(dict.fromkeys(ids))  # dedupe, keep order (vLLM)
        else:
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")

    def _verify(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must be within the int64 range [-2**63, 2**63 - 1] (or -1 for none), "
                             f"got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None and value < -1:
                raise ValueError(f"{name} must be non-negative, or -1 for the whole vocabulary (or None for none), "
                                 f"got {value}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got stop={self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings are only supported when detokenize is True, got stop={self.stop!r} "
                             "with detokenize=False; set detokenize=True to use stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")

    def verify_against_engine(self, *, max_n: int, max_logprobs: int, vocab_size: int) -> None:
        """Check the limits that depend on the engine; raise ValueError naming the parameter."""
        if self.n > max_n:
            raise ValueError(f"n must be at most {max_n}, got {self.n}; raise scheduler.max_n in the engine "
                             "config to allow more")
        # As vLLM: -1 asks for the whole vocabulary, and scheduler.max_logprobs = -1 allows it.
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (vocab_size if value == -1 else value) > limit:
                raise ValueError(f"{name} must be at most {limit}, got {value}"
                                 f"{f' (the whole vocabulary, {vocab_size})' if value == -1 else ''}; raise "
                                 "scheduler.max_logprobs in the engine config (-1: no limit) to allow more")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise ValueError(f"stop_token_ids: token id {token_id} is out of vocabulary "
                                 f"(vocab_size {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A deep copy (e.g. one per sequence of an n > 1 request), without re-running validation."""
        return copy.deepcopy(self)
