"""`moestream replay TRACE`: compare eviction policies and prefetch strategies on a trace."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from actors.pool.eviction import POLICY_NAMES
from actors.prefetch import STRATEGY_NAMES
from pipeline.replay import RECORDED

if TYPE_CHECKING:
    from actors.routing_trace import RoutingTrace
    from pipeline.replay import ReplayResult

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
    import msgspec
    import structlog

    from actors.routing_trace import load_trace
    from pipeline.replay import sweep

    log = structlog.get_logger("moestream.replay")
    try:
        trace = load_trace(args.trace)
        slots = args.slots or [trace.pool.num_slots]
        results = sweep(trace, args.policies, args.strategies, slots)
    except ValueError as exc:  # a trace that does not load or fit: refused before any replay
        print(f"error: {exc}", file=sys.stderr)
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
