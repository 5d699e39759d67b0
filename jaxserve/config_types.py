"""Type checks of config values against their fields' annotations (jaxserve/config.py's sections)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean (true or false)", str: "a string",
               dict: "a mapping", type(None): "null"}


def matches_type(value: Any, hint: Any) -> bool:
    """Whether `value` has the annotated type: unions, `tuple[X, ...]` (a list or tuple of X), and scalars,
    with an int accepted for a float and a bool accepted only for a bool."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(matches_type(value, arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(matches_type(v, typing.get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


def describe_type(hint: Any) -> str:
    """`int | None` -> 'an integer or null'; `tuple[int, ...]` -> 'a list of integers'."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(describe_type(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return "a list of " + {int: "integers", str: "strings"}.get(typing.get_args(hint)[0], "values")
    return _TYPE_NAMES.get(origin or hint, getattr(hint, "__name__", str(hint)))


def check_type(name: str, value: Any, hint: Any) -> None:
    if not matches_type(value, hint):
        raise ValueError(f"{name} must be {describe_type(hint)}, got {value!r} ({type(value).__name__})")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A config dataclass's field annotations, resolved (this module uses postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def check_fields(config: Any, section: str) -> None:
    """Type-check every field of a section (its __post_init__ starts here); ints given for floats become
    floats and lists given for tuples become tuples, so equal configs compare and hash equal."""
    for name, hint in field_types(type(config)).items():
        value = getattr(config, name)
        check_type(f"{section}.{name}", value, hint)
        if isinstance(value, int) and not isinstance(value, bool) and matches_type(0.5, hint):
            object.__setattr__(config, name, float(value))
        elif isinstance(value, list):
            object.__setattr__(config, name, tuple(value))
