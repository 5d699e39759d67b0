"""What crosses the pipe between the server and its engine process (jaxserve/engine_process.py), as frames
(jaxserve/framing.py: a JSON header and a raw payload; never pickle).

    server -> engine   prepared request: header {request_id, prompt, params, max_tokens, ...}, payload the
                       prompt's token ids (little-endian int32)
    engine -> server   per step, each changed request's delta against what was sent before:
                       {"id", "fin", "cached",
                        "seqs": [[index, text_start, text, new token ids, cumulative logprob, new logprobs,
                                  finish_reason, stop_reason], ...] (changed sequences only),
                        "m": [arrival, first token, finished] times (when they changed),
                        "pl": prompt logprobs (once, when known)}
                       and the engine's stats (EngineStats as a JSON object; engine_process.STATS_INTERVAL_S says when)

OutputDeltas (engine side) turns the engine's cumulative RequestOutputs into deltas; OutputAssembler (server
side) turns them back into cumulative RequestOutputs, equal to the engine's, with fresh lists each time as the
engine's are. A logprob entry is [token id, logprob, rank, decoded token]; JSON floats round-trip exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.core.kv_cache_manager import KVCacheStats
from jaxserve.engine_client import EngineStats, PreparedRequest
from jaxserve.framing import bytes_to_ids, ids_to_bytes
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["OutputAssembler", "OutputDeltas", "decode_prepared", "decode_stats", "encode_prepared", "encode_stats"]

_PREPARED_FIELDS = ("request_id", "prompt", "max_tokens", "seed", "priority", "cache_salt", "arrival_time", "tenant",
                    "kv_transfer_params")


def encode_prepared(prepared: PreparedRequest) -> tuple[dict[str, Any], bytes]:
    header = {name: getattr(prepared, name) for name in _PREPARED_FIELDS}
    header["params"] = dataclasses.asdict(prepared.params)
    return header, ids_to_bytes(prepared.prompt_token_ids)


def decode_prepared(header: dict[str, Any], payload: bytes) -> PreparedRequest:
    return PreparedRequest(prompt_token_ids=bytes_to_ids(payload), params=SamplingParams(**header["params"]),
                           **{name: header[name] for name in _PREPARED_FIELDS})


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))


def encode_stats(stats: EngineStats) -> dict[str, Any]:
    data = {name: getattr(stats, name) for name in _STATS_FIELDS}
    if stats.kv_cache is not None:
        data["kv_cache"] = dataclasses.astuple(stats.kv_cache)
    return data


def decode_stats(data: dict[str, Any]) -> EngineStats:
    data = dict(data)
    if data["kv_cache"] is not None:
        data["kv_cache"] = KVCacheStats(*data["kv_cache"])
    for name in ("expert_load", "kv_tier_usage"):
        data[name] = tuple(map(tuple, data[name]))
    for name in ("expert_device_load_max_over_mean", "spec_accepted_per_position"):
        data[name] = tuple(data[name])
    return EngineStats(**data)


def _encode_logprobs(entry: dict[int, Logprob]) -> list[list]:
    return [[token, lp.logprob, lp.rank, lp.decoded_token] for token, lp in entry.items()]


def _decode_logprobs(entry: list[list]) -> dict[int, Logprob]:
    return {token: Logprob(logprob, rank, decoded) for token, logprob, rank, decoded in entry}


@dataclasses.dataclass(slots=True)
class _Sent:
    """What the server has of one sequence."""

    text: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0
    finish_reason: str | None = None


class OutputDeltas:
    """Engine side: the delta of each output against what was sent of its request before."""

    def __init__(self) -> None:
        # request id -> (sequences, [prompt logprobs sent, times sent])
        self._sent: dict[str, tuple[list[_Sent], list]] = {}

    def encode(self, output: RequestOutput) -> dict[str, Any]:
        state = self._sent.get(output.request_id)
        if state is None:
            state = self._sent[output.request_id] = ([], [False, None])
        sent, request_sent = state
        while len(sent) < len(output.outputs):
            sent.append(_Sent())
        seqs = []
        for seq, done in zip(output.outputs, sent):
            text = seq.text
            start = len(done.text) if text.startswith(done.text) else 0
            new_tokens = seq.token_ids[done.num_tokens:]
            if not new_tokens and start == len(text) and seq.finish_reason == done.finish_reason:
                continue
            logprobs = None
            if seq.logprobs is not None:
                logprobs = [_encode_logprobs(entry) for entry in seq.logprobs[done.num_logprobs:]]
                done.num_logprobs = len(seq.logprobs)
            seqs.append([seq.index, start, text[start:], new_tokens, seq.cumulative_logprob, logprobs,
                         seq.finish_reason, seq.stop_reason])
            done.text, done.num_tokens, done.finish_reason = text, len(seq.token_ids), seq.finish_reason
        delta: dict[str, Any] = {"id": output.request_id, "fin": output.finished, "cached": output.num_cached_tokens,
                                 "seqs": seqs}
        metrics = output.metrics
        times = None if metrics is None else (metrics.arrival_time, metrics.first_token_time, metrics.finished_time)
        if times != request_sent[1]:
            delta["m"] = times
            request_sent[1] = times
        if output.prompt_logprobs is not None and not request_sent[0]:
            delta["pl"] = [None if entry is None else _encode_logprobs(entry) for entry in output.prompt_logprobs]
            request_sent[0] = True
        if output.finished:
            del self._sent[output.request_id]
        return delta


@dataclasses.dataclass(slots=True)
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[CompletionOutput]
    prompt_logprobs: list | None = None
    times: list | None = None  # [arrival, first token, finished]


class OutputAssembler:
    """Server side: each request's deltas back into its cumulative RequestOutputs."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, prepared: PreparedRequest) -> None:
        params = prepared.params
        with_logprobs = params.logprobs is not None
        seqs = [CompletionOutput(i, "", [], 0.0 if with_logprobs else None, [] if with_logprobs else None)
                for i in range(params.n)]
        self._requests[prepared.request_id] = _Request(prepared.prompt, prepared.prompt_token_ids, seqs,
                                                       times=[prepared.arrival_time, None, None])

    def abort(self, request_id: str) -> RequestOutput | None:
        """The request finished with "abort" where it stands (the engine refused it)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self.apply({"id": request_id, "fin": True, "cached": 0, "seqs": [
            [seq.index, len(seq.text), "", [], seq.cumulative_logprob, None, "abort", None]
            for seq in request.seqs if seq.finish_reason is None]})

    def apply(self, delta: dict[str, Any]) -> RequestOutput | None:
        """The request's output after `delta`; None for a request not (or no longer) added."""
        request = self._requests.get(delta["id"])
        if request is None:
            return None
        for index, start, text, new_tokens, cumulative, logprobs, finish_reason, stop_reason in delta["seqs"]:
            seq = request.seqs[index]
            seq.text = seq.text[:start] + text
            seq.token_ids = seq.token_ids + new_tokens
            seq.cumulative_logprob = cumulative
            if logprobs is not None:
                seq.logprobs = seq.logprobs + [_decode_logprobs(entry) for entry in logprobs]
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        if "pl" in delta:
            request.prompt_logprobs = [None if entry is None else _decode_logprobs(entry) for entry in delta["pl"]]
        if "m" in delta:
            request.times = delta["m"]
        if delta["fin"]:
            del self._requests[delta["id"]]
        metrics = None if request.times is None else RequestMetrics(*request.times)
        # Lists are replaced above, never changed in place: an output a consumer keeps stays as it was.
        outputs = [CompletionOutput(seq.index, seq.text, seq.token_ids, seq.cumulative_logprob, seq.logprobs,
                                    seq.finish_reason, seq.stop_reason) for seq in request.seqs]
        return RequestOutput(delta["id"], request.prompt, request.prompt_token_ids, outputs, delta["fin"],
                             delta["cached"], request.prompt_logprobs, metrics)
