"""Eviction policies and prefetch strategies on calibrated routing (actors/routing_model).

    python benchmarks/routing_experiments.py [--families a,b] [--layers 16] [--out DIR]

For each family: one workload trace (4 requests alternating between 2 prompt domains,
64-token prompts prefilled in chunks of 16, 300 generated tokens each), replayed through
`pipeline.replay.simulate` for every eviction policy (no prefetch) and every prefetch
strategy (under LRU and under the best policy) at pool sizes given per layer; `--uniform`
then adds uniform routing (what random-weight containers do) as a baseline. Writes
routing-<family>.json under --out; benchmarks/routing_report.py turns them into tables
(routing.md) and curves (routing.png).

Traces keep `--layers` of the model's layers (every statistic here is per layer and each
layer is drawn from the same distribution); bytes per token are scaled to the full depth,
and LFU's decay period (in ticks, one per token and layer) is scaled so that it decays as
much per token as the live default (0.9 per 512 ticks) at full depth. The other policies
count time in tokens or not at all.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.routing_model.families import FAMILIES  # noqa: E402
from actors.routing_model.model import RoutingParams  # noqa: E402
from actors.routing_model.workload import Workload, workload_trace  # noqa: E402
from pipeline.replay import simulate  # noqa: E402

FRACTIONS = (0.0625, 0.125, 0.18, 0.25, 0.36, 0.5)  # of a layer's experts (93/512 = 0.18)
POLICIES: list[tuple[str, str, dict[str, float]]] = [
    ("lru", "lru", {}),
    ("lfu", "lfu", {"decay": 0.9, "period": 512}),  # the live default
    ("lfu-fast", "lfu", {"decay": 0.5, "period": 64}),
    ("slru", "slru", {}),
    ("flru", "flru", {}),  # weight 10 tokens per use, as flash-moe
    ("flru-w1", "flru", {"weight": 1.0}),
    ("reuse", "reuse", {}),
    ("pin-15%", "pin", {"fraction": 0.15}),
    ("pin-50%", "pin", {"fraction": 0.5}),
]
STRATEGIES = ("none", "next-gate", "history", "transition", "history+transition")
GIB = 1 << 30


class Row(msgspec.Struct):
    family: str
    per_layer: int
    slots: int
    policy: str
    strategy: str
    hit_rate: float
    mb_per_token: float  # full depth
    precision: float
    recall: float


def run_family(family: str, layers: int, out: Path) -> list[Row]:
    shape, _ = FAMILIES[family]
    w = Workload(family=family, layers=layers)
    trace = workload_trace(w)
    L, E = trace.model.num_layers, trace.model.num_experts
    tokens = w.requests * (w.prompt_tokens + w.decode_tokens)
    scale = shape.num_layers / L
    gib_per_layer = GIB // trace.model.stride // shape.num_layers  # a 1 GiB pool, per layer
    # A prefill chunk pins up to chunk x top_k experts of one layer: smaller pools are refused.
    smallest = min(E, w.prefill_chunk * trace.model.top_k)
    budgets = sorted(b for b in {*(round(f * E) for f in FRACTIONS), gib_per_layer}
                     if b * L >= smallest)
    rows: list[Row] = []

    def one(per_layer: int, label: str, policy: str, params: dict[str, float], strategy: str) -> Row:
        if policy == "lfu":
            # LFU's period counts ticks (one per token and layer): scale it so that it
            # decays as much per token on this shallower trace as at full depth.
            period = max(1, round(params["period"] * L / shape.num_layers))
            params = {"decay": params["decay"], "period": period}
        r = simulate(trace, policy, params, strategy, per_layer * L)
        row = Row(
            family=family, per_layer=per_layer, slots=per_layer * L, policy=label,
            strategy=strategy, hit_rate=round(r.hit_rate, 4),
            mb_per_token=round(r.bytes_read / tokens * scale / 2**20, 1),
            precision=round(r.prefetch.precision, 3), recall=round(r.prefetch.recall, 3),
        )
        rows.append(row)
        print(f"{family} {per_layer:4d}/layer {label:8s} {strategy:18s} hit {row.hit_rate:.4f}"
              f" {row.mb_per_token:8.1f} MB/token", flush=True)
        return row

    for per_layer in budgets:
        for label, policy, params in POLICIES:
            one(per_layer, label, policy, params, "none")
    by_policy: dict[str, float] = {}
    for row in rows:
        by_policy[row.policy] = by_policy.get(row.policy, 0.0) + row.hit_rate
    best = max((p for p in by_policy if p != "lru"), key=lambda p: by_policy[p])
    best_spec = next(p for p in POLICIES if p[0] == best)
    for per_layer in budgets:
        for label, policy, params in (POLICIES[0], best_spec):
            for strategy in STRATEGIES[1:]:
                one(per_layer, label, policy, params, strategy)
    doc: dict[str, Any] = {
        "family": family, "workload": w, "trace_layers": L, "full_layers": shape.num_layers,
        "experts": E, "top_k": trace.model.top_k, "stride": trace.model.stride,
        "gib_pool_per_layer": gib_per_layer, "best_policy": best, "rows": rows,
    }
    (out / f"routing-{family}.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc)))
    return rows


def add_uniform(family: str, layers: int, out: Path) -> None:
    """Rows for uniform routing (what random-weight containers do) at the same budgets."""
    path = out / f"routing-{family}.json"
    doc = msgspec.json.decode(path.read_bytes())
    shape, _ = FAMILIES[family]
    w = Workload(family=family, layers=layers)
    flat = RoutingParams(skew=0.0, latent_scale=0.0, persistence=0.0, reuse=0.0,
                         reuse_decay=0.0, universal_boost=0.0)
    trace = workload_trace(w, params=flat)
    L = trace.model.num_layers
    tokens = w.requests * (w.prompt_tokens + w.decode_tokens)
    rows = [r for r in doc["rows"] if not r["policy"].startswith("uniform")]
    for per_layer in sorted({r["per_layer"] for r in rows}):
        for policy in ("lru", "lfu"):
            params = {"decay": 0.9, "period": max(1, round(512 * L / shape.num_layers))}
            r = simulate(trace, policy, params if policy == "lfu" else {}, "none", per_layer * L)
            rows.append(msgspec.structs.asdict(Row(
                family=family, per_layer=per_layer, slots=per_layer * L,
                policy=f"uniform-{policy}", strategy="none", hit_rate=round(r.hit_rate, 4),
                mb_per_token=round(r.bytes_read / tokens * shape.num_layers / L / 2**20, 1),
                precision=0.0, recall=0.0)))
            print(family, per_layer, f"uniform-{policy}", rows[-1]["hit_rate"], flush=True)
    doc["rows"] = rows
    path.write_bytes(msgspec.json.format(msgspec.json.encode(doc)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/routing"))
    ap.add_argument("--uniform", action="store_true",
                    help="only add uniform-routing baseline rows to existing JSON")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.families.split(","):
        if args.uniform:
            add_uniform(family, args.layers, args.out)
            continue
        t0 = time.time()
        run_family(family, args.layers, args.out)
        print(f"{family}: {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
