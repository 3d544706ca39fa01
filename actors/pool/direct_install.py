"""Where each expert tensor of a blob goes in the pool's memory: the byte ranges of a
direct (DMA) install (actors/cuda_direct.py), computed from the layout alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from actors.pool.layout import PoolLayout
from qpack.spec import ExpertFormat


def direct_ok(layout: PoolLayout) -> bool:
    """Whether every tensor is stored as the blob holds it (no widening on the way in)."""
    return all(layout.arrays[layout.names[layer][t.name]][2] == t.nbytes
               for layer, fmt in layout.formats.items() for t in fmt.tensors)


def direct_copies(
    layout: PoolLayout,
    base: Mapping[str, int],
    items: Sequence[tuple[int, np.ndarray]],
    layer_format: Callable[[int], tuple[ExpertFormat, dict[str, str]]],
) -> list[tuple[int, int, int]]:
    """(device address, host address, bytes) per tensor of every (slot, blob): a slot row
    of array `a` starts at base[a] + slot * (a's bytes per slot); arrays are row-major."""
    copies: list[tuple[int, int, int]] = []
    for slot, blob in items:
        fmt, names = layer_format(slot)
        src = blob.ctypes.data
        for t in fmt.tensors:
            name = names[t.name]
            row = layout.arrays[name][2]
            copies.append((base[name] + slot * row, src + t.offset, t.nbytes))
    return copies
