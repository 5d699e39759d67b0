"""The requests of `jaxserve bench throughput` and `jaxserve bench serve`: one generator and one file
reader, so that both modes run the same requests given the same seed, lengths and tokenizer (the online
path's throughput is then compared with the offline path's on identical work). No JAX here.

    random: lengths uniform in [len * (1 - r), len * (1 + r)], all input lengths first, then all output
            lengths, from one numpy Generator seeded with --seed; then each prompt's token ids, drawn
            uniformly from [0, vocab_size) less the tokenizer's special ids
    file:   JSON lines {"prompt": str} or {"prompt_token_ids": [...]}, with an optional "output_len"
            ("max_tokens" is read as its alias)

fingerprint() hashes the prompts and output lengths; both modes print it and write it to their JSON
report, so two reports show whether they ran the same requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids
    output_len: int  # tokens to generate (max_tokens; the benchmarks set ignore_eos)


def random_requests(seed: int, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, special_ids: Iterable[int] = ()) -> list[BenchRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low, high = max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio))
        return rng.integers(low, max(low, high) + 1, num_prompts)

    vocabulary = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, np.int64))
    if vocabulary.size == 0:
        raise ValueError(f"no token ids to draw prompts from (vocab_size {vocab_size}, all special)")
    input_lens, output_lens = lengths(input_len), lengths(output_len)
    return [BenchRequest(rng.choice(vocabulary, n).tolist(), int(m)) for n, m in zip(input_lens, output_lens)]


def prompt_objects(path: str | Path, flag: str, bare_strings: bool = False) -> list[tuple[str, dict]]:
    """The prompt objects of a JSON-lines file (`jaxserve generate --prompts-file` and the bench modes'
    `--dataset-path`), in order, blank lines skipped: ("path:line", object with "prompt" or
    "prompt_token_ids"). `bare_strings`: a line holding a JSON string is {"prompt": it}. A missing file
    names `flag`; a bad line raises ValueError naming the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path} not found") from None
    objects = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON: {err}") from None
        if bare_strings and isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & set(item)):
            raise ValueError(f"{where}: expected an object with 'prompt' or 'prompt_token_ids'")
        objects.append((where, item))
    return objects


def read_requests(path: Path, default_output_len: int) -> list[BenchRequest]:
    """Every request of a JSON-lines file, in order (blank lines skipped); ValueError names a bad line."""
    requests = []
    for where, item in prompt_objects(path, "--dataset-path"):
        prompt = item["prompt_token_ids"] if "prompt_token_ids" in item else item["prompt"]
        if not (isinstance(prompt, str) or isinstance(prompt, list)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise ValueError(f"{where}: 'prompt' must be a string and 'prompt_token_ids' a list of integers")
        output_len = item.get("output_len", item.get("max_tokens", default_output_len))
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
            raise ValueError(f"{where}: output_len must be a positive integer, got {output_len!r}")
        requests.append(BenchRequest(prompt, output_len))
    if not requests:
        raise ValueError(f"--dataset-path {path} holds no requests")
    return requests


def fingerprint(requests: Sequence[BenchRequest]) -> str:
    """A short hash of the requests' prompts and output lengths, in order."""
    data = json.dumps([[r.prompt, r.output_len] for r in requests], separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:16]
