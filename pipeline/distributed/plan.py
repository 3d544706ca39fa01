"""Which rank runs which layers: equal counts, weights, or boundaries the user gives.

Every rank computes the same plan from the same inputs (the model's layer count, the
config, and the probes every rank shares at the handshake), so no plan travels.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class PlanError(ValueError):
    """A split that cannot work: more ranks than layers, boundaries out of order."""


class StagePlan(msgspec.Struct, frozen=True):
    """One rank's share: layers [start, stop) of `num_layers`, among `size` ranks."""

    rank: int
    size: int
    start: int
    stop: int
    num_layers: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def first(self) -> bool:
        """Embeds the tokens, samples and serves."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Computes the head (final norm and logits)."""
        return self.rank == self.size - 1


def equal_boundaries(num_layers: int, size: int) -> list[int]:
    """First layer of ranks 1..size-1 for equal counts (earlier ranks take the extra one:
    rank 0 also embeds, the last also runs the head, so neither should get more)."""
    return weighted_boundaries(num_layers, [1.0] * size)


def weighted_boundaries(num_layers: int, weights: Sequence[float]) -> list[int]:
    """First layer of ranks 1.. with counts proportional to `weights`, each rank >= 1 layer.

    Largest-remainder rounding, so the counts add up to `num_layers` and no rank is off
    its exact share by a whole layer (unless raised to its one layer).
    """
    size = len(weights)
    if size > num_layers:
        raise PlanError(f"{size} ranks but the model has only {num_layers} layers: "
                        "each rank needs at least one")
    if any(w <= 0 for w in weights):
        raise PlanError(f"rank weights must be positive, got {list(weights)}")
    total = sum(weights)
    exact = [num_layers * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    # Largest remainders take the layers left; a rank raised to its one layer gives back.
    order = sorted(range(size), key=lambda r: (-(exact[r] - int(exact[r])), r))
    for r in order[: max(0, num_layers - sum(counts))]:
        counts[r] += 1
    while sum(counts) > num_layers:
        r = max((r for r in range(size) if counts[r] > 1), key=lambda r: counts[r] - exact[r])
        counts[r] -= 1
    bounds, at = [], 0
    for c in counts[:-1]:
        at += c
        bounds.append(at)
    return bounds


def check_boundaries(num_layers: int, size: int, boundaries: Sequence[int]) -> list[int]:
    """User-given boundaries (distributed.boundaries), checked against the job."""
    bounds = list(boundaries)
    if len(bounds) != size - 1:
        raise PlanError(f"distributed.boundaries has {len(bounds)} entries; {size} ranks need "
                        f"{size - 1} (the first layer of ranks 1..{size - 1})")
    edges = [0, *bounds, num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise PlanError(f"distributed.boundaries {bounds} must rise strictly within "
                        f"1..{num_layers - 1} (the model has {num_layers} layers)")
    return bounds


def with_moe_layers(boundaries: Sequence[int], num_layers: int, moe: Sequence[int],
                    given: bool = False) -> list[int]:
    """Boundaries under which every rank runs at least one MoE layer: a rank keeps an
    expert pool and a reader, and a slice of dense layers only (DeepSeek's and GLM's first
    layers) would have no experts to size them by. A computed split keeps each boundary
    where it may and moves it the least otherwise, either way (MoE layers first and dense
    ones last, or interleaved, as well as dense ones first); boundaries the user gave
    (`given`) are refused instead."""
    edges = [0, *boundaries, num_layers]
    size = len(edges) - 1
    moe = sorted(moe)
    if size > len(moe):
        raise PlanError(f"{size} ranks but the model has only {len(moe)} MoE layers: "
                        "each rank needs at least one")
    if given:
        for r in range(size):
            if not any(edges[r] <= m < edges[r + 1] for m in moe):
                raise PlanError(f"distributed.boundaries {list(boundaries)} give rank {r} layers "
                                f"{edges[r]}-{edges[r + 1] - 1}, none of them a MoE layer: "
                                "each rank needs at least one")
        return edges[1:-1]
    for r in range(size - 1):
        # Past this rank's first MoE layer, and no later than the MoE layer that must
        # open the rest (each later rank needs one of its own).
        lo = next(m for m in moe if m >= edges[r]) + 1
        hi = moe[len(moe) - (size - 1 - r)]
        edges[r + 1] = min(max(edges[r + 1], lo), hi)
    return edges[1:-1]


def plan_for(rank: int, size: int, num_layers: int, boundaries: Sequence[int]) -> StagePlan:
    edges = [0, *boundaries, num_layers]
    return StagePlan(rank, size, edges[rank], edges[rank + 1], num_layers)


def share_weights(free_mb: Sequence[float], read_mb_s: Sequence[float]) -> list[float]:
    """A rank's weight: half its share of the job's free memory (its pool and dense core
    fit there), half its share of the job's disk speed (its reads come from there)."""
    mem, disk = sum(free_mb), sum(read_mb_s)
    return [0.5 * (m / mem if mem > 0 else 1 / len(free_mb))
            + 0.5 * (d / disk if disk > 0 else 1 / len(read_mb_s))
            for m, d in zip(free_mb, read_mb_s, strict=True)]
