"""The emulated gate-ahead's two parameters (actors/routing_model/model.py) against what
they should reproduce.

    python benchmarks/gate_fit.py [family] [share,noise ...]

For each (gate_share, gate_noise) pair (default: the family's fitted pair and the old
context-only gate at the same noise), over 3 requests of 200 tokens in one domain, layers
1..L-1, prints: the gate's per-token recall (|guess & routed| / k), a 3-token pass's
recall (the union of the three guesses against the union routed), and the consecutive-
token overlap of the routing and of the guesses. The fit holds the per-token recall near
the published ~46 % (or what the old gate gave, where the family's routing caps it) and
the guesses' overlap at the routing's: a real gate applied to each token's own hidden
state guesses each token's routing, so its guesses differ token to token as the routing
does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.routing_model.families import FAMILIES  # noqa: E402
from actors.routing_model.model import RoutingModel  # noqa: E402

PASS = 3  # positions of a k=2 verify pass


def measure(family: str, share: float, noise: float, n: int = 200, seeds: int = 3) -> list[float]:
    shape, params = FAMILIES[family]
    params = msgspec.structs.replace(params, gate_share=share, gate_noise=noise)
    k = shape.top_k
    one, union, over_r, over_g = [], [], [], []
    for seed in range(seeds):
        model = RoutingModel(shape, params, seed=seed)
        ids, gates = model.tokens(seed, n, np.random.default_rng(seed + 100), gate=True)
        assert gates is not None
        for layer in range(1, shape.num_layers):
            routed = [set(ids[t, layer].tolist()) for t in range(n)]
            guess = [set(gates[t, layer].tolist()) for t in range(n)]
            one += [len(r & g) / k for r, g in zip(routed, guess, strict=True)]
            over_r += [len(routed[t] & routed[t + 1]) / k for t in range(n - 1)]
            over_g += [len(guess[t] & guess[t + 1]) / k for t in range(n - 1)]
            for t in range(0, n - PASS + 1, PASS):
                ru, gu = set().union(*routed[t : t + PASS]), set().union(*guess[t : t + PASS])
                union.append(len(ru & gu) / len(ru))
    return [float(np.mean(x)) for x in (one, union, over_r, over_g)]


def main() -> None:
    family = sys.argv[1] if len(sys.argv) > 1 else "qwen3.6-35b"
    params = FAMILIES[family][1]
    pairs = [tuple(float(v) for v in a.split(",")) for a in sys.argv[2:]] or [
        (params.gate_share, params.gate_noise), (0.0, 0.0)]
    print("family share noise | recall/token recall/pass | overlap routing guesses")
    for share, noise in pairs:
        one, union, over_r, over_g = measure(family, share, noise)
        print(f"{family} {share:.2f} {noise:.2f} | {one:.3f} {union:.3f} | {over_r:.3f} {over_g:.3f}")


if __name__ == "__main__":
    main()
