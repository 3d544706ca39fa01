"""The synthetic checkpoints' presets and their config.json as the hub writes it, by family.

Each family module (qpack.families) lists its presets (`ModelDims`) and writes its own
config.json; this module is the lookup over all of them: `get_preset(family, preset)`,
with a full-size preset name implying its family.
"""

from __future__ import annotations

from typing import Any

from qpack.families import family, names
from qpack.synth.dims import ModelDims

FAMILIES: tuple[str, ...] = names()
PRESETS: dict[tuple[str, str], ModelDims] = {
    (fam, name): dims for fam in FAMILIES for name, dims in family(fam).presets.items()
}
# Named presets that imply their family.
FULL_SIZE: dict[str, str] = {name: fam for fam in FAMILIES for name in family(fam).full_size}


def preset_names() -> list[str]:
    return sorted({name for _, name in PRESETS})


def get_preset(family_name: str | None, preset: str) -> ModelDims:
    """Look up a preset; a full-size preset name implies its family (and must agree with it)."""
    implied = FULL_SIZE.get(preset)
    if implied is not None:
        if family_name is not None and family_name != implied:
            raise ValueError(f"preset {preset!r} belongs to family {implied!r}, not {family_name!r}")
        family_name = implied
    if family_name is None:
        raise ValueError(f"preset {preset!r} needs a family: one of {list(FAMILIES)}")
    if family_name not in FAMILIES:
        raise ValueError(f"unknown family {family_name!r}: expected one of {list(FAMILIES)}")
    dims = PRESETS.get((family_name, preset))
    if dims is None:
        known = sorted(name for fam, name in PRESETS if fam == family_name)
        raise ValueError(f"unknown preset {preset!r} for family {family_name!r}: expected one of {known}")
    dims.check()
    return dims


def hf_config(dims: ModelDims, torch_dtype: str, layout: str = "hub") -> dict[str, Any]:
    """The source checkpoint's config.json for `layout` (one of the family's layouts)."""
    fam = family(dims.family)
    if layout not in fam.layouts:
        raise ValueError(f"unknown layout {layout!r}: expected {' or '.join(repr(x) for x in fam.layouts)}")
    return fam.hf_config(dims, torch_dtype, layout)
