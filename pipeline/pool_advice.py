"""Pool advice for a container (`moestream info`): expected hits at a few pool sizes.

A quick replay of calibrated routing (actors/routing_model: fitted to published
measurements of trained routers) shaped like the container (experts per layer, top-k,
expert bytes), through the real pool bookkeeping (`pipeline.replay.simulate`) with the
default eviction policy, with the emulated next-gate prefetch (the default strategy) and
without prefetch. Two decode-only requests in different prompt domains, a few layers
(every layer of the model has the same statistics, so hits per layer carry over; the
pool's share per layer is what matters). 0.5-1 s on a 2-core VM.

These are expectations for a *trained* model's routing; a random-weight container
(bench-container, synth) routes almost uniformly and hits about at slots / experts.
"""

from __future__ import annotations

import math

import msgspec

from actors.routing_model.model import RoutingShape
from actors.routing_model.source import family_for
from actors.routing_model.workload import Workload, workload_trace

SHARES = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)  # per-layer slots as a share of the experts
TARGETS = (0.5, 0.7, 0.8)
GIB = 2**30
REPLAY_LAYERS = 4
TOKENS = 128  # per request


class AdviceRow(msgspec.Struct, frozen=True):
    slots_per_layer: int
    share: float  # of each layer's experts (random routing hits about this)
    pool_mb: int
    hit_default: float  # default eviction + emulated next-gate
    hit_no_prefetch: float  # default eviction, no prefetch
    one_gib: bool = False  # the row of a 1 GiB pool


class PoolAdvice(msgspec.Struct, frozen=True):
    family: str  # whose fitted parameters routed the replay
    eviction: str
    rows: list[AdviceRow]
    pool_mb_for_hits: dict[str, int | None]  # "50%" -> smallest pool MiB reaching it (None: above the rows)
    note: str
    borrowed_for: str | None = None  # the model type whose routers have no published statistics


def _slot_options(num_experts: int, top_k: int, one_gib: int) -> list[int]:
    opts = {max(top_k, round(num_experts * s)) for s in SHARES}
    if top_k <= one_gib < num_experts:
        opts.add(one_gib)
    return sorted(o for o in opts if o < num_experts)


def _interpolate(rows: list[AdviceRow], target: float) -> int | None:
    """Pool MiB where the default setting's hit rate crosses `target` (log-linear in size)."""
    prev: AdviceRow | None = None
    for row in rows:
        if row.hit_default >= target:
            if prev is None:
                return row.pool_mb
            f = (target - prev.hit_default) / max(row.hit_default - prev.hit_default, 1e-9)
            return round(math.exp(math.log(prev.pool_mb) + f * (math.log(row.pool_mb) - math.log(prev.pool_mb))))
        prev = row
    return None


def pool_advice(moe_layers: int, num_experts: int, top_k: int, stride: int,
                eviction: str = "reuse", seed: int = 0, borrowed_for: str | None = None) -> PoolAdvice:
    """`borrowed_for`: the container's model type when its routers have no published
    statistics (the note says whose fitted parameters replayed it)."""
    from pipeline.replay import simulate

    family = family_for(num_experts, top_k)
    layers = min(REPLAY_LAYERS, moe_layers)
    shape = RoutingShape(f"container ({family} parameters)", layers, num_experts, top_k)
    work = Workload(family=family, requests=2, prompt_tokens=0, decode_tokens=TOKENS, seed=seed)
    # The few replayed layers stand for the whole depth: the middles of equal slices.
    depths = [(i + 0.5) / layers for i in range(layers)] if layers < moe_layers else None
    trace = workload_trace(work, policy=eviction, shape=shape, stride=stride, depths=depths)
    one_gib = GIB // (stride * moe_layers)
    rows = []
    for slots in _slot_options(num_experts, top_k, one_gib):
        with_gate = simulate(trace, eviction, {}, "recorded", slots * layers)
        plain = simulate(trace, eviction, {}, "none", slots * layers)
        rows.append(AdviceRow(
            slots_per_layer=slots, share=round(slots / num_experts, 4),
            pool_mb=-(-slots * moe_layers * stride // 2**20),
            hit_default=round(with_gate.hit_rate, 3), hit_no_prefetch=round(plain.hit_rate, 3),
            one_gib=slots == one_gib,
        ))
    return PoolAdvice(
        family=family, eviction=eviction, rows=rows, borrowed_for=borrowed_for,
        pool_mb_for_hits={f"{t:.0%}": _interpolate(rows, t) for t in TARGETS},
        note=(f"decode hit rates replayed on calibrated routing ({family} parameters, fitted "
              f"to published traces of trained routers; docs/routing.md"
              + (f"; borrowed: no published routing statistics for {borrowed_for}" if borrowed_for else "")
              + f"): 2 requests "
              f"x {TOKENS} tokens in 2 domains, {layers} layers, eviction {eviction}, with the "
              "emulated next-gate (default) and without prefetch; the first replayed layer is "
              "never predicted (as the engine's first MoE layer), so with few layers the "
              "next-gate column is conservative (up to ~9 points at top-10). A random-weight "
              "container routes almost uniformly: about the per-layer share."),
    )
