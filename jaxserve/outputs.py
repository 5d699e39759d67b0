"""What a request returns (vLLM's RequestOutput / CompletionOutput / Logprob) and the per-sequence state
that produces it.

    scheduler RequestUpdate (new token ids, Logprobs, finished?) ──► OutputStream.append
        ├─ IncrementalDetokenizer.add_tokens ──► text delta
        ├─ stop strings searched in each token's text (+ lookback) ──► matched stop string (the first
        │  listed, when several complete at one token): text truncated, returned
        └─ Logprobs ──► dict[token_id, Logprob] (sampled token first, then the top-N), cumulative_logprob
    engine: finish(finish_reason, stop_reason) ──► completion_output() ──► RequestOutput
    runner PromptLogprobs chunks ──► PromptLogprobsStream.add (by prompt position)
        ──► RequestOutput.prompt_logprobs

Text semantics follow vLLM V1: the text never contains the stop string that ended the request (unless
include_stop_str_in_output); a token that ended the request (eos or a stop_token_id) is left out of the text
unless include_stop_str_in_output; token ids after a stop-string match stay in token_ids, as generated.
While running, completion_output() holds back the last len(longest stop) - 1 characters (vLLM's
output_text_buffer_length), so every text it returns is a prefix of the final text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from jaxserve.core.sched_types import Logprobs, PromptLogprobs

__all__ = ["CompletionOutput", "Logprob", "OutputStream", "PromptLogprobsStream", "RequestMetrics", "RequestOutput"]

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass
class Logprob:
    """The log-probability of one token; `rank` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were requested
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token; None unless requested
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id; None for eos, length, abort

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """Timestamps of one request (`time.monotonic()` seconds; vLLM's RequestMetrics subset)."""

    arrival_time: float
    first_token_time: float | None = None  # the first generated token of any of its n sequences reached the host
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """Everything one request has produced so far (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing scores it),
    # entry i = {prompt token i: its Logprob, then the top-N by rank}; None until every entry is known.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None


class OutputStream:
    """The output state of one generated sequence: token ids, text, logprobs, stop-string matching.

    Invariants: `text` only grows, except that a stop-string match truncates it (never before the text
    completion_output() has returned, thanks to the hold-back); stop strings are searched only in the new text
    plus len(stop) - 1 characters before it, so the work per step does not grow with the output.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int],
                 index: int = 0):
        self.tokenizer = tokenizer
        self.params = params
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._stop_matched: str | None = None  # the stop string that ended the sequence: no more text
        self._detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                             if params.detokenize else None)
        # Characters completion_output() withholds while running: a stop string may still start there.
        self._hold_back = (max(map(len, params.stop)) - 1
                           if params.stop and not params.include_stop_str_in_output else 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, new_token_ids: Sequence[int], logprobs_per_token: Sequence[Logprobs | None] | None,
               finished_by_token: bool, cut_at_stop: bool = False) -> str | None:
        """Add this step's tokens; return the stop string they completed (the sequence must then finish with
        stop_reason = that string), else None. Tokens after the one that completed a stop string stay, as
        vLLM keeps the rest of a step's tokens, unless `cut_at_stop` (speculative decoding's accepted runs:
        the output must equal appending one token per step). `finished_by_token`: the last token is an eos
        or stop token id that ends the sequence. `logprobs_per_token`: one runner Logprobs per token when
        logprobs were asked."""
        if self.finished or self._stop_matched is not None:
            raise RuntimeError(f"OutputStream.append after the sequence ended (finish_reason={self.finish_reason}, "
                               f"stop string={self._stop_matched!r})")
        new_token_ids = list(new_token_ids)
        if self.logprobs is not None:
            self._add_logprobs(new_token_ids, logprobs_per_token)
        num_before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        if self._detokenizer is None or not new_token_ids:
            return None
        # NOTE: as vLLM V1, the token that ended the sequence is not detokenized unless the stop is to be included.
        to_text = new_token_ids[:-1] if finished_by_token and not self.params.include_stop_str_in_output \
            else new_token_ids
        # As vLLM: text from the first min_tokens tokens is never searched for stop strings.
        num_unchecked = max(0, min(len(to_text), self.params.min_tokens - num_before))
        if num_unchecked:
            self.text += self._detokenizer.add_tokens(to_text[:num_unchecked])
        if not self.params.stop:
            self.text += self._detokenizer.add_tokens(to_text[num_unchecked:])
            return None
        # Token by token, so appending k tokens at once stops where appending them one by one would have.
        for i, token_id in enumerate(to_text[num_unchecked:], num_before + num_unchecked + 1):
            check_from = len(self.text)
            self.text += self._detokenizer.add_tokens([token_id])
            if (stop := self._check_stop(check_from)) is not None:
                if cut_at_stop:
                    self._drop_after(i)
                return stop
        return None

    def _drop_after(self, num_tokens: int) -> None:
        """Keep the first num_tokens token ids (and their logprobs)."""
        if num_tokens < len(self.token_ids):
            del self.token_ids[num_tokens:]
            if self.logprobs is not None:
                for entry in self.logprobs[num_tokens:]:
                    self.cumulative_logprob -= next(iter(entry.values())).logprob
                del self.logprobs[num_tokens:]

    def _check_stop(self, check_from: int) -> str | None:
        """Find a stop string completed in text[check_from:] (the text of one token, or the final flush);
        truncate the text there. When several complete there, the one listed first in `stop` wins, as
        in vLLM (e.g. stop=["bc", "b"] and a token "bc" after "a" leave "a")."""
        params = self.params
        if not params.stop or check_from == len(self.text) or len(self.token_ids) <= params.min_tokens:
            return None
        for stop in params.stop:
            # A match not wholly inside the already-checked text starts at most len(stop) - 1 chars before it.
            at = self.text.find(stop, max(0, check_from - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at + len(stop)] if params.include_stop_str_in_output else self.text[:at]
                self._stop_matched = stop
                return stop
        return None

    def _add_logprobs(self, new_token_ids: list[int], logprobs_per_token: Sequence[Logprobs | None] | None) -> None:
        num_top = self.params.logprobs if self.params.logprobs != -1 else None  # -1: all (the runner sliced them)
        if (logprobs_per_token is None or len(logprobs_per_token) != len(new_token_ids)
                or any(entry is None for entry in logprobs_per_token)):
            raise ValueError(f"logprobs={num_top} was requested, so each of the {len(new_token_ids)} new tokens "
                             f"needs a Logprobs, got {logprobs_per_token!r}")
        decode = self.tokenizer if self._detokenizer is not None else None
        for token_id, entry in zip(new_token_ids, logprobs_per_token):
            self.logprobs.append(logprob_entry(token_id, entry.sampled_logprob, entry.sampled_rank,
                                               entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], decode))
            self.cumulative_logprob += entry.sampled_logprob

    def finish(self, finish_reason: str, stop_reason: int | str | None = None) -> str | None:
        """Mark the sequence finished and flush held-back text. If the flushed text completes a stop string
        (not for "abort"), the text is truncated there, the finish becomes ("stop", that string) and the string
        is returned; else None. A stop string matched by append() also wins over a "length" or eos finish of
        the same step (as vLLM). A second finish() is a no-op that keeps the first reason."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
        if self.finished:
            return None
        matched = None
        if self._stop_matched is not None:
            if finish_reason != "abort":
                finish_reason, stop_reason = "stop", self._stop_matched
        elif self._detokenizer is not None:
            check_from = len(self.text)
            self.text += self._detokenizer.finish()
            if finish_reason != "abort" and (matched := self._check_stop(check_from)) is not None:
                finish_reason, stop_reason = "stop", matched
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return matched

    def completion_output(self) -> CompletionOutput:
        """A snapshot of the sequence so far (its lists are copies)."""
        text = self.text
        if self._hold_back and not self.finished and self._stop_matched is None:
            text = text[:max(0, len(text) - self._hold_back)]
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float],
                  tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """One position's logprobs dict in vLLM's order: the chosen (sampled or prompt) token first, then the
    top-N by rank; a chosen token that is also in the top-N keeps its first position, with the same values.
    Each token is decoded alone without skipping special tokens (as vLLM: eos shows as "</s>", a byte that
    is part of a character as U+FFFD); decoded_token is None without a tokenizer (detokenize=False)."""

    def decode(token: int) -> str | None:
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else None

    entries = {token_id: Logprob(logprob, rank, decode(token_id))}
    for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
        if top_id not in entries:
            entries[top_id] = Logprob(top_logprob, top_rank, decode(top_id))
    return entries


class PromptLogprobsStream:
    """The prompt logprobs of one request, filled by prompt position from the runner's chunks.

    A position already filled ignores a later chunk (a preempted request recomputes its prompt; the n
    sequences of a request each compute them), so entries are neither lost nor repeated. A chunk whose
    scored tokens are not this prompt's (a stale chunk of an earlier request with the same id) is dropped.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.entries: list[dict[int, Logprob] | None] = [None] * len(self.prompt_token_ids)
        self.num_missing = len(self.prompt_token_ids) - 1

    def add(self, chunk: PromptLogprobs) -> None:
        stop = chunk.start + len(chunk.token_ids)
        if chunk.start < 1 or self.prompt_token_ids[chunk.start: stop] != list(chunk.token_ids):
            return
        for i, position in enumerate(range(chunk.start, stop)):
            if self.entries[position] is None:
                self.entries[position] = logprob_entry(chunk.token_ids[i], chunk.logprobs[i], chunk.ranks[i],
                                                       chunk.top_token_ids[i], chunk.top_logprobs[i], self.tokenizer)
                self.num_missing -= 1

    def result(self) -> list[dict[int, Logprob] | None] | None:
        """Every entry (the first None) once all are known, else None."""
        return list(self.entries) if self.num_missing == 0 else None
