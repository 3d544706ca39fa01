"""Prefetch strategies: which experts later layers will need, and how well that was guessed.

`make_strategy(name, ...)` builds one by name (the `STRATEGIES` table); `PrefetchScorer`
scores its predictions against the true routing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from actors.prefetch.registry import (
    GATE_STRATEGIES,
    STRATEGIES,
    STRATEGY_NAMES,
    StrategyArgs,
    build_strategy,
    strategies_help,
)
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
    "GATE_STRATEGIES",
    "STRATEGIES",
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
    "strategies_help",
]


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
    """Build a strategy by its registry name (`STRATEGIES`, actors/prefetch/registry.py)."""
    return build_strategy(name, StrategyArgs(
        moe_layers, num_experts, top_k, routers, depth, max_per_layer, combine, extra,
        history_decay))
