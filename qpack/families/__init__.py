"""The model families moestream packs and streams: one module each, found by `model_type`.

Adding a family is one module here (its `FAMILY`: names, layout, synth presets, see
`base.CheckpointFamily`), its forward side in pipeline/models/families/ under the same
name, and one entry in MODULES. Nothing else in the code names a family: the packer, the
reader, synth and the forward pass ask `family(model_type)`. See docs/families.md.
"""

from __future__ import annotations

import importlib
from functools import cache

from qpack.families.base import CheckpointFamily, TokenizerFacts

# The registry: one line per family (the module name is the family's model_type).
MODULES = ("qwen3_next", "qwen3_5_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
DEFAULT = "qwen3_next"  # the family of a `synth:<preset>` source that names none

__all__ = ["DEFAULT", "MODULES", "CheckpointFamily", "TokenizerFacts", "UnsupportedModel", "canonical",
           "family", "names"]


class UnsupportedModel(ValueError):
    """A model_type no family module reads (the message is one line, naming what is supported)."""


@cache
def _families() -> dict[str, CheckpointFamily]:
    out: dict[str, CheckpointFamily] = {}
    for module in MODULES:
        fam = importlib.import_module(f"qpack.families.{module}").FAMILY
        assert fam.name == module, f"qpack/families/{module}.py defines family {fam.name!r}"
        out[fam.name] = fam
    return out


@cache
def _aliases() -> dict[str, str]:
    return {alias: fam.name for fam in _families().values() for alias in (fam.name, *fam.aliases)}


def names() -> tuple[str, ...]:
    """Every family's name (its container model_type), in registry order."""
    return tuple(_families())


def canonical(model_type: object) -> str | None:
    """The family a source or container model_type belongs to, or None."""
    return _aliases().get(model_type) if isinstance(model_type, str) else None


def family(model_type: object) -> CheckpointFamily:
    """The family of `model_type` (an alias included); one line naming the supported ones if none."""
    name = canonical(model_type)
    if name is None:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; supported: "
                               f"{', '.join(names())}")
    return _families()[name]
