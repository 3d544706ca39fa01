"""`bench --routing`: which experts the benchmarked forward passes choose.

- `router`: the container's own routers (random weights: nearly uniform routing, the
  pool's worst case);
- `calibrated`: the routing model's ids for each (request, position, MoE layer), fitted
  to published measurements of trained routers (actors/routing_model/), with the real
  reads and compute; gate strategies still apply the container's routers, so next-gate's
  accuracy is measured honestly (and is poor: those routers do not decide any more);
- `calibrated-gate`: the same ids, and gate strategies see the routing model's emulated
  gate-ahead (recall fitted to the published ~46 %): what a trained model's gate gives.

Benchmark only: a result measured so carries the override's label in `routing`.
"""

from __future__ import annotations

from typing import Any

import structlog

from pipeline import engine_hooks as hooks

log = structlog.get_logger()

ROUTINGS = ("router", "calibrated", "calibrated-gate")


def calibrate(engine: Any, routing: str, seed: int) -> Any:
    """Route `engine`'s model by `routing` (request 0 first); the override, or None for
    router."""
    if routing == "router":
        return None
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; valid: {', '.join(ROUTINGS)}")
    facts = engine.facts
    if not facts.attention_layers:
        # The token's position is the first KV cache's offset; DeltaNet states have none.
        raise ValueError("calibrated routing needs a full-attention layer (its KV offset is the "
                         "token's position) and this model has none: use more layers (--max-layers >= 4)")
    from actors.routing_model.source import CalibratedSource
    from pipeline.models.routing_override import RoutingOverride
    from qpack.families import family

    # A family whose routers have no published statistics is routed by another's fitted
    # parameters: the label (on every result row) and the log say so.
    borrowed = None if family(facts.model_type).published_routing else facts.model_type
    source = CalibratedSource(len(facts.moe_layers), facts.num_experts, facts.top_k, seed=seed,
                              borrowed_for=borrowed)
    if borrowed is not None:
        log.warning("bench.routing_borrowed", model_type=borrowed, parameters=source.family)
    override = RoutingOverride(source, facts.moe_layers, emulate_gate=routing == "calibrated-gate")
    hooks.use_routing(engine, override)
    override.begin_request(0)
    return override
