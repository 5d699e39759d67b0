"""Speculative decoding in `jaxserve bench throughput | latency`: its flags, counters and report.

    --speculative-config JSON          vLLM's mapping (the speculative section), as on `jaxserve serve`
    --spec-synthetic-acceptance A      bench only, labelled synthetic: every decode row guesses k tokens
                                       (the proposer's, padded) and each guess is accepted with probability
                                       A while the ones before it were, drawn on the device
                                       (runner/spec_verify.py), whatever the model says: the engine's cost
                                       curve over acceptance, with outputs that are not the model's.
                                       `latency` takes a list (0,0.5,0.8): one engine runs each in turn
                                       (A is a step input: no compile between them)

    engine counters before and after a run --report--> spec_decode: {drafts, draft_tokens, accepted_tokens,
        acceptance_rate, mean_accepted_length, per_position_acceptance, synthetic_acceptance}

Definitions (vLLM's): a draft is one step of one request with guesses; acceptance rate = accepted /
draft tokens; mean accepted length = 1 + accepted / drafts (tokens a request gains per verified step,
the target's own token included); per-position acceptance[j] = drafts whose guess j was accepted /
drafts. Under synthetic acceptance A with k guesses, mean accepted length = 1 + A (1 - A^k) / (1 - A).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from jaxserve.config import EngineConfig


def parse_acceptances(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected acceptance rates in [0, 1] separated by commas, got {text!r}")
    bad = [value for value in values if not 0.0 <= value <= 1.0]
    if bad:
        raise argparse.ArgumentTypeError(f"acceptance rates must be in [0, 1], got {bad[0]}")
    return values


def parse_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_args(parser: argparse.ArgumentParser, several: bool) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative-config", type=parse_json, metavar="JSON",
                       help="vLLM's speculative_config, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    group.add_argument("--spec-synthetic-acceptance", type=parse_acceptances, metavar="A,..." if several else "A",
                       help="SYNTHETIC, outputs not meaningful: every decode row guesses k tokens and each is "
                            "accepted with probability A (in [0, 1]) while the earlier ones were, for the engine's "
                            "overhead curve" + ("; several values run one after another in one engine" if several
                                                else ""))


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.speculative_config is None else {"speculative_config": args.speculative_config}


def apply(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """The config with the synthetic acceptance set (the first value of a list), checked."""
    values = args.spec_synthetic_acceptance
    if values is None:
        return config
    if not config.speculative.enabled:
        raise ValueError("--spec-synthetic-acceptance needs speculative decoding: give --speculative-config "
                         "(e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}') or a speculative section")
    speculative = dataclasses.replace(config.speculative, synthetic_acceptance=values[0])
    return dataclasses.replace(config, speculative=speculative)


def acceptances(args: argparse.Namespace) -> list[float | None]:
    """The runs' synthetic acceptance rates ([None]: real acceptance, or speculation off)."""
    return args.spec_synthetic_acceptance or [None]


def set_acceptance(engine, acceptance: float | None) -> None:
    """Switch the synthetic acceptance between runs (a device input of verification: nothing compiles)."""
    if acceptance is not None:
        engine.runner.synthetic_acceptance = acceptance


def counters(engine) -> tuple[int, int, int, tuple[int, ...]]:
    """(drafts, draft tokens, accepted tokens, accepted per position): the engine's totals now."""
    stats = engine.stats()
    return (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens,
            stats.spec_accepted_per_position)


def report(engine, before: tuple, after: tuple, acceptance: float | None) -> dict[str, Any] | None:
    """The spec_decode section of a run between two `counters` snapshots; None with speculation off."""
    speculative = engine.config.speculative
    if not speculative.enabled:
        return None
    drafts, draft_tokens, accepted = (b - a for a, b in zip(before[:3], after[:3]))
    per_position = [b - (before[3][j] if j < len(before[3]) else 0) for j, b in enumerate(after[3])]
    k = speculative.num_speculative_tokens
    result = {
        "method": speculative.method, "num_speculative_tokens": k,
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [count / drafts for count in per_position] if drafts else [],
        "synthetic_acceptance": acceptance,
    }
    if acceptance is not None:
        result["note"] = f"synthetic acceptance {acceptance:g} (outputs not meaningful)"
        result["expected_mean_accepted_length"] = 1 + sum(acceptance ** j for j in range(1, k + 1))
    return result


def describe(section: dict[str, Any] | None) -> list[str]:
    """The report's lines for a spec_decode section."""
    if section is None:
        return []
    lines = []
    if section["synthetic_acceptance"] is not None:
        lines.append(f"SYNTHETIC: {section['note']}")
    rate, length = section["acceptance_rate"], section["mean_accepted_length"]
    positions = " ".join(f"{value:.3f}" for value in section["per_position_acceptance"])
    lines.append(f"spec decode ({section['method']}, k={section['num_speculative_tokens']}): "
                 f"{section['num_drafts']} drafts, {section['num_draft_tokens']} draft tokens, "
                 f"{section['num_accepted_tokens']} accepted; acceptance rate "
                 f"{'n/a' if rate is None else f'{rate:.3f}'}, mean accepted length "
                 f"{'n/a' if length is None else f'{length:.3f}'}"
                 + (f" (expected {section['expected_mean_accepted_length']:.3f})"
                    if "expected_mean_accepted_length" in section else "")
                 + f"; per-position acceptance [{positions}]")
    return lines
