"""Banks: the pool's slots cut into ranges no expert kernel indexes past its limit.

MLX's CUDA `gather_qmm` (qmm_sm80, MLX 0.32.4 and its main branch as of 2026-12) finds
an expert's weights at `rhs_index * (n * k)` elements computed in 32 bits, so a slot whose
offset passes 2^32 elements (2^31 where signed) reads another slot's bytes: with every
expert of the 35B pooled (10,240 slots; 2^20 elements a projection) slots from ~4,096 on
gave wrong outputs (session 23, benchmarks/gather_qmm_index_probe.py: |diff| up to 7.3; the
single-row qmv kernel was right). mlx-lm never meets it: its arrays hold one layer's
experts. Metal's kernels offset by 64-bit strides (mlx/backend/metal/kernels/quantized.h);
the banks apply on every backend all the same, as a slice costs nothing.

So a pool larger than the limit is cut into banks, each a range of slots within it; each
MoE layer has a home bank, its experts only ever take slots there (actors/pool/slots.py),
and the forward gathers from its bank's slice of the pool's arrays with slot indices
relative to the bank's start (`PoolStorage.view`): a slice is an offset pointer, no copy,
the same kernels. Layers are spread over the fewest banks that fit, in proportion to the
slots. A pool within the limit is one bank, exactly as before. A routing trace records
the limit (`TraceModel.bank_limit`), so `moestream replay` cuts its pools the same way.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from actors.pool.layout import PoolLayout

# Elements a kernel's offset into one pool array may reach: the signed 32-bit bound, to
# be safe (the failing product is unsigned in qmm_sm80, but a signed one fails at half).
INDEX_LIMIT = 2**31


class Banks:
    """Slot ranges (`ranges[b]`) and each MoE layer's home bank (`home[layer]`)."""

    def __init__(self, ranges: Sequence[range], home: dict[int, int]) -> None:
        self.ranges = list(ranges)
        self.home = dict(home)
        self._starts = [r.start for r in self.ranges]

    def __len__(self) -> int:
        return len(self.ranges)

    def of_layer(self, layer: int) -> range:
        """The slots `layer`'s experts may take."""
        return self.ranges[self.home[layer]]

    def of_slot(self, slot: int) -> int:
        """The bank holding `slot`."""
        return bisect.bisect_right(self._starts, slot) - 1

    @property
    def smallest(self) -> int:
        return min(len(r) for r in self.ranges)


def slot_limit(layout: PoolLayout) -> int:
    """The most slots one pool array may hold and still be indexed right: INDEX_LIMIT over
    the largest tensor's elements per slot (a quantized weight counts its unpacked ones)."""
    worst = 1
    for fmt in layout.formats.values():
        for t in fmt.tensors:
            proj, _, kind = t.name.rpartition(".")
            bits = fmt.quant(proj)[0] if kind == "weight" else None
            # A packed weight holds 8 / bits elements a byte, whatever its words' dtype.
            elements = t.nbytes * 8 // bits if bits else math.prod(t.shape)
            worst = max(worst, elements)
    return max(1, INDEX_LIMIT // worst)


def plan_banks(num_slots: int, layers: Sequence[int], limit: int) -> Banks | None:
    """None when `num_slots` fit one bank of `limit`; else the fewest banks of at most
    `limit` slots, whole layers in each, slots shared in proportion to the layers. Where
    even one layer's share passes the limit, banks are cut at the limit and the slots past
    them go unused (a model whose layer alone is bigger than a kernel can index)."""
    if num_slots <= limit or not layers:
        return None
    n = len(layers)
    for count in range(min(math.ceil(num_slots / limit), n), n + 1):
        cuts = [i * n // count for i in range(count + 1)]
        bounds = [num_slots * c // n for c in cuts]
        if max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) <= limit or count == n:
            break
    ranges = [range(a, min(b, a + limit)) for a, b in zip(bounds, bounds[1:], strict=False)]
    home = {layer: b for b in range(count) for layer in layers[cuts[b]:cuts[b + 1]]}
    return Banks(ranges, home)
