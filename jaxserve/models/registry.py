"""HF `architectures` string -> model family; HF config.json -> that family's frozen model config.

Everything outside `jaxserve/models/` reaches a model through here: the loader and checkpoint code
(`family_of(cfg).abstract`, `.hf_tensor_table`, `.param_init`), the runner (`.forward`,
`.init_kv_caches`, `.param_placer`). A family is a `ModelFamily` object (models/family.py states
what each of its functions must do); its config carries `architecture`, which names it here.

Adding a family touches `models/` only: its module (the math, `config_from_hf` / `to_hf_config`,
`hf_tensor_table`, and a `FAMILY = ModelFamily(...)`) plus one `register(architecture, FAMILY)`
line per HF architecture string at the end of this file. Tests and plugins may `register` at run
time too.

Unsupported architectures and field values are refused with a message naming the field, the value
and what is supported, so no checkpoint is ever half understood.
"""

from __future__ import annotations

from typing import Any

from jaxserve.models import llama_hf, moe_hf
from jaxserve.models.family import SUPPORTED_ROPE_TYPES, ModelFamily, UnsupportedModelError  # noqa: F401

ARCHITECTURES: dict[str, ModelFamily] = {}


def register(architecture: str, family: ModelFamily, *, replace: bool = False) -> None:
    """Serve checkpoints whose config.json names `architecture` with `family`."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register({architecture!r}, ...) needs a ModelFamily, got {type(family).__name__}")
    if architecture in ARCHITECTURES and ARCHITECTURES[architecture] is not family and not replace:
        raise ValueError(f"architecture {architecture!r} is already registered to family "
                         f"{ARCHITECTURES[architecture].name!r}; pass replace=True to override it")
    ARCHITECTURES[architecture] = family


def unregister(architecture: str) -> None:
    ARCHITECTURES.pop(architecture, None)


def family(architecture: str) -> ModelFamily:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedModelError(f"unsupported architecture {architecture!r}; jaxserve supports "
                                    f"{sorted(ARCHITECTURES)}") from None


def family_of(cfg: Any) -> ModelFamily:
    """The family of a model config (by its `architecture` field)."""
    return family(cfg.architecture)


def _architecture(hf: dict[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UnsupportedModelError(
            f"{source}: 'architectures' is missing or empty; expected one of {sorted(ARCHITECTURES)}"
        )
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"{source}: unsupported architecture {archs}; jaxserve supports {sorted(ARCHITECTURES)}"
    )


def config_from_hf(hf: dict[str, Any], dtype: str = "auto", source: str = "config.json") -> Any:
    """The model config of a parsed HF config.json, by the family of its first registered architecture."""
    arch = _architecture(hf, source)
    return ARCHITECTURES[arch].config_from_hf(hf, dtype=dtype, source=source, architecture=arch)


def to_hf_config(cfg: Any, **extra: Any) -> dict[str, Any]:
    """The config.json describing `cfg` (the inverse of config_from_hf), e.g. for a trained model."""
    return family_of(cfg).to_hf_config(cfg, **extra)


for _arch in llama_hf.VARIANTS:
    register(_arch, llama_hf.FAMILY)
for _arch in moe_hf.ARCHITECTURES:
    register(_arch, moe_hf.FAMILY)
