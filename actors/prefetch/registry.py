"""The prefetch strategies by name: one row each, as the eviction policies' table.

A row says how to build the strategy from `StrategyArgs`, whether it needs the model's
gates (then `replay` cannot rerun it and uses the trace's recorded predictions), whether
`prefetch.depth` means anything to it, and the line the CLI's help shows. Adding a
strategy is adding a row; the config's check, `--help` and `replay` read the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.prefetch.strategies import (
    Combined,
    History,
    NoPrefetch,
    PrefetchStrategy,
    Transition,
)

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass(frozen=True)
class StrategyArgs:
    """What a strategy may be built from (each takes the fields it uses)."""

    moe_layers: Sequence[int]
    num_experts: int
    top_k: int
    routers: Callable[[int, mx.array], mx.array] | None = None
    depth: int = 1
    max_per_layer: int | None = None
    combine: Sequence[str] = ()
    extra: int = 0
    history_decay: float = 0.95


@dataclass(frozen=True)
class StrategyRow:
    build: Callable[[StrategyArgs], PrefetchStrategy]
    help: str
    gate: bool = False  # needs the model's routers
    uses_depth: bool = False


def _gate(depth_from_args: bool) -> Callable[[StrategyArgs], PrefetchStrategy]:
    def build(a: StrategyArgs) -> PrefetchStrategy:
        if a.routers is None:
            name = "lookahead" if depth_from_args else "next-gate"
            raise ValueError(f"prefetch strategy {name!r} needs routers (the model's gates)")
        # Deferred: only gate strategies need MLX, and `replay` runs without it.
        from actors.prefetch.gate import NextGate

        return NextGate(a.routers, moe_layers=a.moe_layers, num_experts=a.num_experts,
                        top_k=a.top_k, depth=a.depth if depth_from_args else 1, extra=a.extra,
                        cap=a.max_per_layer)

    return build


def _combined(a: StrategyArgs) -> PrefetchStrategy:
    if not a.combine or "combined" in a.combine:
        raise ValueError(
            f"prefetch strategy 'combined' needs combine=[names of other strategies], "
            f"got {list(a.combine)!r}"
        )
    parts = [build_strategy(n, a) for n in a.combine]
    return Combined(parts, a.max_per_layer or a.top_k + a.extra)


STRATEGIES: dict[str, StrategyRow] = {
    "none": StrategyRow(lambda a: NoPrefetch(), "no prefetch: read on demand"),
    "next-gate": StrategyRow(_gate(False), "the next MoE layer's gate on this hidden state",
                             gate=True),
    "lookahead": StrategyRow(_gate(True), "the gates of the next `depth` MoE layers",
                             gate=True, uses_depth=True),
    "history": StrategyRow(
        lambda a: History(moe_layers=a.moe_layers, num_experts=a.num_experts, top_k=a.top_k,
                          decay=a.history_decay, depth=a.depth),
        "the experts each layer used most, decayed", uses_depth=True),
    "transition": StrategyRow(
        lambda a: Transition(moe_layers=a.moe_layers, num_experts=a.num_experts, top_k=a.top_k),
        "which experts follow this layer's choice in the next layer"),
    "combined": StrategyRow(_combined, "rank fusion of the strategies in prefetch.combine"),
}
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)
GATE_STRATEGIES: tuple[str, ...] = tuple(n for n, row in STRATEGIES.items() if row.gate)
DEPTH_STRATEGIES: tuple[str, ...] = tuple(n for n, row in STRATEGIES.items() if row.uses_depth)


def build_strategy(name: str, args: StrategyArgs) -> PrefetchStrategy:
    row = STRATEGIES.get(name)
    if row is None:
        raise ValueError(
            f"unknown prefetch strategy {name!r}; valid names: {', '.join(STRATEGY_NAMES)}"
        )
    return row.build(args)


def strategies_help() -> str:
    """One clause per strategy, for `--strategy`'s help."""
    return "; ".join(f"{name}: {row.help}" for name, row in STRATEGIES.items())
