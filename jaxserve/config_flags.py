"""The engine config as command-line flags, shared by `jaxserve generate` and `jaxserve serve`.

    every config field      -> --field-name VALUE  (`--max-num-seqs 8`; model.path is `--model`; a name
                               that is taken, by another section or by the command itself, gets its
                               section's prefix: `--parallel-model`)
    every vLLM engine name  -> --its-name VALUE    (`--tensor-parallel-size 2`: config.VLLM_NAMES,
                               config.NOT_SUPPORTED)
    parsed arguments --overrides()--> {override key: value} --EngineConfig.with_overrides--> checked config

A VALUE is read as YAML (`8`, `0.5`, `true`, `null`, `[16, 64]`), except for string fields, which take the
text as it is (`null` still means None where the field allows it). A boolean flag given bare means true
(`--enable-prefix-caching`, `--trust-remote-code`), as in vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection
from typing import Any

import yaml

from jaxserve.config import BENCH_ONLY, NOT_SUPPORTED, SECTIONS, VLLM_NAMES, VLLM_SECTIONS, VLLM_SWITCHES
from jaxserve.config_types import field_types, matches_type

NULLS = ("null", "none", "None")


# Fields whose bare name says too little on a command line: their flag is always --section-name.
SECTION_PREFIXED = {("speculative", "method")}


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    flag: str  # --max-num-seqs
    key: str  # what EngineConfig.with_overrides takes: `section.field`, `model`, or a vLLM name
    group: str  # the config section, or "vllm" for vLLM's names
    hint: Any  # the annotation the value must satisfy
    help: str


def config_flags(reserved: Collection[str] = (), skip_sections: Collection[str] = ()) -> list[ConfigFlag]:
    """One flag per config field and per vLLM name; `reserved`: flags the command defines itself;
    `skip_sections`: sections the command has no use for (their vLLM names are left out too)."""
    flags: dict[str, ConfigFlag] = {}
    for section, cls in SECTIONS.items():
        if section in skip_sections:
            continue
        for name, hint in field_types(cls).items():
            if (section, name) in BENCH_ONLY:
                continue
            is_path = (section, name) == ("model", "path")
            bare = "model" if is_path else name
            flag = "--" + bare.replace("_", "-")
            if flag in flags or flag in reserved or (section, name) in SECTION_PREFIXED:
                flag = f"--{section}-{bare.replace('_', '-')}"
            flags[flag] = ConfigFlag(flag, "model" if is_path else f"{section}.{name}", section, hint,
                                     f"{section}.{name} ({_name(hint)})")
    for name, (section, field) in VLLM_NAMES.items():
        if section in skip_sections:
            continue
        flags["--" + name.replace("_", "-")] = ConfigFlag(
            "--" + name.replace("_", "-"), name, "vllm", field_types(SECTIONS[section])[field],
            f"vLLM's name for {section}.{field}")
    for name, (section, _, text) in VLLM_SECTIONS.items():
        if section not in skip_sections:
            flags["--" + name.replace("_", "-")] = ConfigFlag("--" + name.replace("_", "-"), name, "vllm",
                                                              dict | None, text)
    for name, (hint, text) in VLLM_SWITCHES.items():
        flags["--" + name.replace("_", "-")] = ConfigFlag("--" + name.replace("_", "-"), name, "vllm", hint, text)
    for name, (accepted, hint, _) in NOT_SUPPORTED.items():
        flags["--" + name.replace("_", "-")] = ConfigFlag(
            "--" + name.replace("_", "-"), name, "vllm", hint, f"accepted at {accepted[0]!r} only (vLLM's name)")
    return list(flags.values())


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def add_config_flags(parser: argparse.ArgumentParser, reserved: Collection[str] = (),
                     repeatable: Collection[str] = (), skip_sections: Collection[str] = ()) -> list[ConfigFlag]:
    """Add the flags to `parser`, grouped by section; `repeatable` keys collect every use in a list."""
    flags = config_flags(reserved, skip_sections)
    groups: dict[str, Any] = {}
    for spec in flags:
        if spec.group not in groups:
            title = ("vLLM's engine-argument names" if spec.group == "vllm"
                     else f"config section '{spec.group}' (overrides the YAML)")
            groups[spec.group] = parser.add_argument_group(title)
        group = groups[spec.group]
        if spec.key in repeatable:
            group.add_argument(spec.flag, dest=spec.flag, action="append", metavar="VALUE",
                               help=spec.help + " (repeatable)")
        elif matches_type(True, spec.hint):
            group.add_argument(spec.flag, dest=spec.flag, nargs="?", const="true", metavar="BOOL", help=spec.help)
        else:
            group.add_argument(spec.flag, dest=spec.flag, metavar="VALUE", help=spec.help)
    return flags


def parse_value(flag: str, text: str, hint: Any) -> Any:
    if matches_type("text", hint):
        return None if text in NULLS and matches_type(None, hint) else text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise ValueError(f"{flag}: cannot read {text!r} as a value") from None


def overrides(args: dict[str, Any], flags: list[ConfigFlag]) -> dict[str, Any]:
    """The flags given (argparse's values, keyed by flag) as EngineConfig.with_overrides keywords."""
    result = {}
    for spec in flags:
        value = args.get(spec.flag)
        if value is not None:
            result[spec.key] = value if isinstance(value, list) else parse_value(spec.flag, value, spec.hint)
    return result
