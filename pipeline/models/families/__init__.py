"""The forward side of each model family, found by the family's name (qpack.families).

`pipeline/models/families/<name>.py` exposes `FAMILY`, a `ForwardFamily` (base.py); the
names are qpack's registry's, so a family registered there without a module here fails
at its first forward with one line (and tests/test_families.py checks every one).
"""

from __future__ import annotations

import importlib
from functools import cache

import mlx.nn as nn

from pipeline.models.families.base import ForwardFamily
from qpack.families import family

__all__ = ["ForwardFamily", "forward_family", "of_model"]


@cache
def forward_family(model_type: str) -> ForwardFamily:
    """The forward side of `model_type`'s family (an alias included)."""
    name = family(model_type).name
    return importlib.import_module(f"pipeline.models.families.{name}").FAMILY


def of_model(model: nn.Module) -> ForwardFamily:
    """The family of an mlx-lm model: its module under mlx_lm.models is the family's name."""
    return forward_family(type(model).__module__.rpartition(".")[2])
