"""`moestream replay`: rerun a recorded routing trace through pool + prefetch policies.

The simulation drives the same `PoolDriver` (actors/pool_driver.py) as the live engine,
in the same order, with one tick per (step, MoE layer):

    for step in trace.steps:            (reset_sequence() when step.seq changes)
        for entry in step.layers:       (MoE layers in order)
            scorer.score(layer, chosen)             # predictions made earlier for it
            driver.demand(layer, chosen, tick)      # unpins the previous layer first
            strategy.observe(layer, chosen)
            preds = strategy.predict(layer, chosen, None)   # or the recorded ones
            scorer.record(preds); driver.prefetch(preds, tick)
            tick += 1

So replaying a trace with the live run's policy, slot count and strategy reproduces the
live hit rate exactly. Gate-based strategies ("next-gate", "lookahead") need the model,
so they replay the predictions recorded in the trace ("recorded" does that for whatever
the live strategy was).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.eviction import POLICY_NAMES, make_policy
from actors.pool_driver import PoolDriver
from actors.prefetch import (
    STRATEGY_NAMES,
    PrefetchScorer,
    PrefetchStats,
    PrefetchStrategy,
    make_strategy,
)
from actors.routing_trace import RoutingTrace, load_trace
from actors.slots import SlotCounters, SlotTable

log = structlog.get_logger(__name__)

RECORDED = "recorded"
GATE_STRATEGIES = ("next-gate", "lookahead")


class ReplayResult(msgspec.Struct):
    policy: str
    policy_params: dict[str, float]
    strategy: str
    num_slots: int
    steps: int
    hit_rate: float
    pool: SlotCounters
    prefetch: PrefetchStats
    bytes_read: int  # demand misses + prefetch installs, x stride
    prefetch_unused_bytes: int  # prefetch installs never demanded before the trace ended


def _strategy_for(
    trace: RoutingTrace, name: str, params: dict[str, Any]
) -> PrefetchStrategy | None:
    """The strategy to rerun, or None to use the trace's recorded predictions."""
    if name == RECORDED:
        return None
    if name in GATE_STRATEGIES:
        if trace.pool.strategy != name:
            raise ValueError(
                f"strategy {name!r} needs the model's routers; this trace recorded "
                f"{trace.pool.strategy!r} predictions. Use {RECORDED!r} to replay those."
            )
        return None
    m = trace.model
    if "+" in name:  # "history+transition": rank fusion of the parts
        params = {"combine": name.split("+"), **params}
        name = "combined"
    return make_strategy(
        name, moe_layers=m.moe_layers, num_experts=m.num_experts, top_k=m.top_k, **params
    )


def simulate(
    trace: RoutingTrace,
    policy_name: str,
    policy_params: dict[str, float] | None,
    strategy_name: str,
    num_slots: int,
    *,
    strategy_params: dict[str, Any] | None = None,
) -> ReplayResult:
    policy = make_policy(policy_name, **(policy_params or {}))
    table = SlotTable(num_slots, policy)
    driver = PoolDriver(table)
    strategy = _strategy_for(trace, strategy_name, strategy_params or {})
    scorer = PrefetchScorer(trace.model.stride)
    tick = 0
    seq: int | None = None
    for step in trace.steps:
        if seq is not None and step.seq != seq and strategy is not None:
            strategy.reset_sequence()
        seq = step.seq
        scorer.begin_token()
        for entry in step.layers:
            scorer.score(entry.layer, entry.chosen)
            driver.demand(entry.layer, entry.chosen, tick)
            if strategy is None:
                preds = entry.predictions
            else:
                strategy.observe(entry.layer, entry.chosen)
                preds = strategy.predict(entry.layer, entry.chosen, None)
            scorer.record(preds)
            driver.prefetch(preds, tick)
            tick += 1
    scorer.begin_token()  # predictions for layers never reached count as wrong
    driver.end_layer()
    counters = table.snapshot()
    stride = trace.model.stride
    return ReplayResult(
        policy=policy_name,
        policy_params=policy.params(),
        strategy=strategy_name,
        num_slots=num_slots,
        steps=len(trace.steps),
        hit_rate=counters.hit_rate,
        pool=counters,
        prefetch=scorer.stats(),
        bytes_read=(counters.misses + counters.prefetch_installs) * stride,
        prefetch_unused_bytes=(counters.prefetch_installs - counters.prefetch_used) * stride,
    )


def sweep(
    trace: RoutingTrace,
    policies: Sequence[str],
    strategies: Sequence[str],
    slots: Sequence[int],
) -> list[ReplayResult]:
    """Every policy x strategy x slot count; the live policy keeps its recorded params."""
    results = []
    for n, policy, strategy in itertools.product(slots, policies, strategies):
        params = trace.pool.policy_params if policy == trace.pool.policy else {}
        results.append(simulate(trace, policy, params, strategy, n))
    return results


def _csv(valid: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in names if any(part not in valid for part in t.split("+"))]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or repr(text)}; valid: {', '.join(valid)}"
            )
        return names

    return parse


def _render(trace: RoutingTrace, results: Sequence[ReplayResult], source: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    m, p = trace.model, trace.pool
    table = Table(
        title=f"replay {source.name}: {len(trace.steps)} steps, {len(m.moe_layers)} MoE layers,"
        f" {m.num_experts} experts top-{m.top_k}; live: {p.num_slots} slots, {p.policy},"
        f" {p.strategy}"
    )
    for col in ("slots", "policy", "strategy"):
        table.add_column(col, no_wrap=True)
    for col in ("hit rate", "precision", "recall", "read MB", "unused MB", "dropped"):
        table.add_column(col, justify="right", no_wrap=True)
    mb = 1024 * 1024
    for r in results:
        table.add_row(
            str(r.num_slots),
            r.policy,
            r.strategy,
            f"{r.hit_rate:.4f}",
            f"{r.prefetch.precision:.3f}" if r.prefetch.predicted else "-",
            f"{r.prefetch.recall:.3f}" if r.prefetch.predicted else "-",
            f"{r.bytes_read / mb:.1f}",
            f"{r.prefetch_unused_bytes / mb:.1f}",
            str(r.pool.prefetch_dropped),
        )
    # Piped output (files, CI logs) gets a fixed wide layout instead of rich's 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.trace)
        slots = args.slots or [trace.pool.num_slots]
        results = sweep(trace, args.policies, args.strategies, slots)
    except ValueError as exc:
        log.error("replay.failed", error=str(exc))
        return 2
    _render(trace, results, Path(args.trace))
    if args.json:
        doc = {
            "trace": str(args.trace),
            "model": trace.model,
            "live_pool": trace.pool,
            "results": results,
        }
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(doc)))
        log.info("replay.json", path=str(args.json), runs=len(results))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    strategies = (RECORDED, *STRATEGY_NAMES)
    parser = sub.add_parser(
        "replay",
        help="replay a recorded routing trace through eviction policies and prefetch strategies",
        description=(
            "Rerun a routing trace (recorded by a live run) through the expert pool's "
            "bookkeeping, without the model, and compare hit rate, prefetch precision / "
            "recall and bytes read per policy x strategy x slot count. Gate-based "
            "strategies replay the trace's recorded predictions ('recorded')."
        ),
    )
    parser.add_argument("trace", type=Path, help="routing trace (.json or .json.gz)")
    parser.add_argument(
        "--policies",
        type=_csv(POLICY_NAMES, "policy"),
        default=list(POLICY_NAMES),
        help=f"comma-separated eviction policies (default: {','.join(POLICY_NAMES)})",
    )
    parser.add_argument(
        "--strategies",
        type=_csv(strategies, "strategy"),
        default=["none", "history", "transition", RECORDED],
        help="comma-separated prefetch strategies (default: none,history,transition,"
        f"recorded; valid: {','.join(strategies)}; join names with + to combine them,"
        " e.g. history+transition)",
    )
    parser.add_argument(
        "--slots",
        type=int,
        nargs="+",
        metavar="N",
        help="pool sizes in slots (default: the live run's)",
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write results as JSON")
    parser.set_defaults(func=run)
