"""Fit actors/routing_model's parameters to the published routing statistics.

    python benchmarks/fit_routing.py [family ...] [--evals N]

A deterministic (fixed seeds, common random numbers) local search over the five
single-request parameters against each family's targets (actors/routing_model/families.py:
the LRU hit curve, plus consecutive-token overlap or top-64 share with a smaller weight).
It prints the best parameters; they are copied into families.py by hand, with the fit's
residuals. The domain parameters (universal boost, domain mix) do not change
single-request statistics and are tuned separately (`--domains`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.routing_model import families  # noqa: E402
from actors.routing_model.model import RoutingModel, RoutingParams  # noqa: E402

FREE = ("skew", "latent_scale", "persistence", "reuse", "reuse_decay", "universal_boost", "explore")
BOUNDS = {
    "skew": (0.0, 4.0),
    "latent_scale": (0.0, 6.0),
    "persistence": (0.0, 0.995),
    "reuse": (0.0, 6.0),
    "reuse_decay": (0.0, 0.995),
    "universal_boost": (0.0, 4.0),
    "explore": (0.0, 0.5),
}


def loss(family: str, params: RoutingParams) -> float:
    m = families.measure(family, params)
    t = families.TARGETS[family]
    err = np.array(m.lru_hit) - np.array(t.lru_hit)
    out = float((err**2).sum()) + 4 * float(max(0.0, np.abs(err).max() - 0.02) ** 2)
    if t.overlap is not None:
        out += 0.25 * (m.overlap - t.overlap) ** 2
    if t.top64_share is not None:
        out += 0.25 * (m.top64_share - t.top64_share) ** 2
    # The domain statistics, exact from the full-depth model's popularity (cheap).
    d = families.domain_stats(RoutingModel(families.FAMILIES[family][0], params, seed=1))
    jm, je, jl = families.JACCARD
    out += 0.1 * ((d.jaccard - jm) ** 2 + (d.jaccard_early - je) ** 2 + (d.jaccard_late - jl) ** 2)
    out += 0.1 * (d.universal - families.UNIVERSAL) ** 2
    return out


def fit(family: str, evals: int, seed: int = 0) -> RoutingParams:
    rng = np.random.default_rng(seed)
    best = families.FAMILIES[family][1]
    best_loss = loss(family, best)
    step = 0.3
    for i in range(evals):
        cand = msgspec.structs.asdict(best)
        for name in FREE:
            lo, hi = BOUNDS[name]
            cand[name] = float(np.clip(cand[name] + step * (hi - lo) * 0.2 * rng.standard_normal(), lo, hi))
        p = RoutingParams(**cand)
        value = loss(family, p)
        if value < best_loss:
            best, best_loss = p, value
            print(f"{family} {i}: loss {best_loss:.5f} {[round(cand[n], 3) for n in FREE]}", flush=True)
        elif i % 25 == 24:
            step = max(0.02, step * 0.85)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("family", nargs="*", default=list(families.FAMILIES))
    ap.add_argument("--evals", type=int, default=200)
    args = ap.parse_args()
    for name in args.family:
        p = fit(name, args.evals)
        print(name, {n: round(getattr(p, n), 3) for n in FREE})
        print(msgspec.json.encode(families.measure(name, p)).decode())
        model = RoutingModel(families.FAMILIES[name][0], p, seed=1)
        print(msgspec.json.encode(families.domain_stats(model)).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
