"""Prefetch strategies: which experts later layers will need, and how well that was guessed.

`make_strategy(name, ...)` builds one by name (`STRATEGY_NAMES`); `PrefetchScorer`
scores its predictions against the true routing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from actors.prefetch.scorer import PrefetchScorer, PrefetchStats
from actors.prefetch.strategies import (
    Combined,
    History,
    NoPrefetch,
    Prediction,
    PrefetchStrategy,
    Transition,
)

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "STRATEGY_NAMES",
    "Combined",
    "History",
    "NoPrefetch",
    "Prediction",
    "PrefetchScorer",
    "PrefetchStats",
    "PrefetchStrategy",
    "Transition",
    "make_strategy",
]

STRATEGY_NAMES = ("none", "next-gate", "lookahead", "history", "transition", "combined")


def make_strategy(
    name: str,
    *,
    moe_layers: Sequence[int],
    num_experts: int,
    top_k: int,
    routers: Callable[[int, mx.array], mx.array] | None = None,
    depth: int = 1,
    max_per_layer: int | None = None,
    combine: Sequence[str] = (),
    extra: int = 0,
    history_decay: float = 0.95,
) -> PrefetchStrategy:
    """Build a strategy by registry name (see STRATEGY_NAMES)."""
    if name == "none":
        return NoPrefetch()
    if name in ("next-gate", "lookahead"):
        if routers is None:
            raise ValueError(f"prefetch strategy {name!r} needs routers (the model's gates)")
        # Deferred: only gate strategies need MLX, and `replay` runs without it.
        from actors.prefetch.gate import NextGate

        return NextGate(
            routers,
            moe_layers=moe_layers,
            num_experts=num_experts,
            top_k=top_k,
            depth=1 if name == "next-gate" else depth,
            extra=extra,
        )
    if name == "history":
        return History(
            moe_layers=moe_layers,
            num_experts=num_experts,
            top_k=top_k,
            decay=history_decay,
            depth=depth,
        )
    if name == "transition":
        return Transition(moe_layers=moe_layers, num_experts=num_experts, top_k=top_k)
    if name == "combined":
        if not combine or "combined" in combine:
            raise ValueError(
                f"prefetch strategy 'combined' needs combine=[names of other strategies], "
                f"got {list(combine)!r}"
            )
        parts = [
            make_strategy(
                n,
                moe_layers=moe_layers,
                num_experts=num_experts,
                top_k=top_k,
                routers=routers,
                depth=depth,
                extra=extra,
                history_decay=history_decay,
            )
            for n in combine
        ]
        return Combined(parts, max_per_layer or top_k + extra)
    raise ValueError(
        f"unknown prefetch strategy {name!r}; valid names: {', '.join(STRATEGY_NAMES)}"
    )
