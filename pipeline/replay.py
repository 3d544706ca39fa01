"""Replay: rerun a recorded routing trace through pool + prefetch policies.

The simulation makes the calls the live engine makes (actors/compute.py `Compute.forward`)
in the same order, driving the same `PoolDriver` (actors/pool/driver.py), with one tick
per (step, MoE layer):

    for step in trace.steps:            (reset_sequence() when step.seq changes)
        decode = step.phase == "decode"
        if decode: scorer.begin_token()
        for entry in step.layers:       (MoE layers in order)
            for row in entry.observed():            # each token of the step, in order
                strategy.observe(layer, row)
            preds = strategy.predict(layer, row 0, None) if decode else []
                                                    # (or the recorded predictions)
            if decode: scorer.score(layer, chosen); scorer.record(preds)
            driver.demand(layer, chosen, tick)      # unpins the previous layer first
            driver.prefetch(preds, tick)
            tick += 1

The live engine learns from every prompt token but predicts, prefetches and scores only
while decoding; the trace keeps each token's row and the phase so that replay does the
same. So replaying a trace with the live run's policy, slot count and strategy reproduces
the live hit rate, prefetch counters and precision / recall exactly. Gate-based strategies ("next-gate", "lookahead") need the model,
so they replay the predictions recorded in the trace ("recorded" does that for whatever
the live strategy was).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog

from actors.pool.banks import plan_banks
from actors.pool.driver import PoolDriver
from actors.pool.eviction import make_policy
from actors.pool.slots import SlotCounters, SlotTable
from actors.prefetch import (
    GATE_STRATEGIES,
    PrefetchScorer,
    PrefetchStats,
    PrefetchStrategy,
    make_strategy,
)
from actors.routing_trace import RoutingTrace

log = structlog.get_logger(__name__)

RECORDED = "recorded"


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
    limit = trace.model.bank_limit
    banks = plan_banks(num_slots, trace.model.moe_layers, limit) if limit else None
    table = SlotTable(num_slots, policy, banks=banks)
    driver = PoolDriver(table)
    strategy = _strategy_for(trace, strategy_name, strategy_params or {})
    scorer = PrefetchScorer(trace.model.stride)
    tick = 0
    seq: int | None = None
    for step in trace.steps:
        if seq is not None and step.seq != seq and strategy is not None:
            strategy.reset_sequence()
        seq = step.seq
        decode = step.phase == "decode"
        if decode:
            scorer.begin_token()
        for entry in step.layers:
            if strategy is None:
                preds = entry.predictions
            else:
                rows = entry.observed()
                for row in rows:
                    strategy.observe(entry.layer, row)
                preds = strategy.predict(entry.layer, rows[0], None) if decode else []
            if decode:
                scorer.score(entry.layer, entry.chosen)
                scorer.record(preds)
            driver.demand(entry.layer, entry.chosen, tick)
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
    """Every policy x strategy x slot count; the live policy and strategy keep their
    recorded params (a history's depth and decay, a combination's parts and cap)."""
    results = []
    for n, policy, strategy in itertools.product(slots, policies, strategies):
        params = trace.pool.policy_params if policy == trace.pool.policy else {}
        sparams = _recorded_strategy_params(trace) if strategy == trace.pool.strategy else {}
        results.append(simulate(trace, policy, params, strategy, n, strategy_params=sparams))
    return results


def _recorded_strategy_params(trace: RoutingTrace) -> dict[str, Any]:
    """The live strategy's `params()` as `make_strategy` takes them."""
    params = dict(trace.pool.strategy_params)
    if "decay" in params:  # History records its own name for it
        params["history_decay"] = params.pop("decay")
    return params
