"""Chat variants of a family: the chat template and generation_config.json that go with them.

The weights do not depend on the variant; Qwen3-Next ships an Instruct and a Thinking
model of the same shapes, Qwen3.5/3.6 one hybrid model that thinks unless told not to.
Each family module lists its variants (the first is the default) and writes its
generation_config.json.
"""

from __future__ import annotations

from typing import Any

from qpack.families import family, names
from qpack.synth.dims import ModelDims

VARIANTS: dict[str, tuple[str, ...]] = {name: family(name).variants for name in names()}


def check_variant(family_name: str, variant: str | None, preset: str | None = None) -> str:
    """The variant to write (the preset's default for None: the family's own chat, or the
    one the preset's release ships); one clear line if unknown or not the preset's."""
    allowed = VARIANTS[family_name] if preset is None else family(family_name).preset_variants(preset)
    if variant is None:
        return allowed[0]
    if variant not in allowed:
        where = family_name if preset is None else f"{family_name} preset {preset}"
        raise ValueError(f"variant {variant!r} does not exist for {where}: expected one of {list(allowed)}")
    return variant


def generation_config(dims: ModelDims, variant: str | None = None) -> dict[str, Any]:
    """generation_config.json as the hub ships it: eos ids and the sampling the model was tuned for."""
    return family(dims.family).generation_config(dims, check_variant(dims.family, variant, dims.name))
