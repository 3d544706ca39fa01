"""Calibrated routing for a live engine: the routing model's trace per (request, position).

Benchmark only. A random-weight container's router picks experts almost uniformly, so its
pool hits at about slots / experts; this gives the engine, for each request, the routing
model's ids (and the emulated gate-ahead's predictions) at every token position and MoE
layer, so the real reads and the real compute follow calibrated routing. Ids are a
function of (seed, request, position, layer) only, never of the pool, the prefetcher or
the tokens: a token recomputed after a miss, or a step undone and redone, routes
identically, and results do not depend on the pool (see pipeline/models/routing_override).

Tables grow by regeneration (doubling): the model draws token after token from one seeded
stream, so the first n rows of a longer draw equal a shorter draw's.
"""

from __future__ import annotations

import numpy as np

from actors.routing_model.families import FAMILIES
from actors.routing_model.model import RoutingModel, RoutingParams, RoutingShape

DOMAINS = 2  # requests alternate between two prompt domains, as the replay workloads do
MIN_ROWS = 256
# The emulated gate ranks this many times top-k experts per layer, so a prefetcher told to
# read beyond top-k (`prefetch.extra`) reads the gate's next guesses, as with a real gate.
GATE_RANKS_PER_K = 4


def family_for(num_experts: int, top_k: int) -> str:
    """The fitted family for a container shape: an exact (experts, top-k) match, else the
    top-10 (Qwen3-Next) parameters for wide routers and the Qwen3.5 ones for narrow."""
    for name, (shape, _) in FAMILIES.items():
        if (shape.num_experts, shape.top_k) == (num_experts, top_k):
            return name
    return "qwen3-next-80b" if top_k >= 10 else "qwen3.5-397b"


class CalibratedSource:
    """Routing tables for `num_layers` MoE layers of `num_experts` experts, top-`top_k`."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        *,
        family: str | None = None,
        params: RoutingParams | None = None,
        seed: int = 0,
        borrowed_for: str | None = None,
    ) -> None:
        """`borrowed_for`: the model type routed, when no statistics of its own routers
        are published (the label says whose parameters stand in for them)."""
        self.family = family or family_for(num_experts, top_k)
        self.borrowed_for = borrowed_for
        if self.family not in FAMILIES:
            raise ValueError(f"unknown routing family {self.family!r}; valid: {', '.join(FAMILIES)}")
        shape = RoutingShape(self.family, num_layers, num_experts, top_k)
        self.model = RoutingModel(shape, params or FAMILIES[self.family][1], seed=seed)
        self.seed = seed
        self.request = 0
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def label(self) -> str:
        if self.borrowed_for is not None:
            return (f"calibrated-model {self.family} parameters, borrowed: no published routing statistics "
                    f"for {self.borrowed_for}, seed {self.seed} (benchmark only)")
        return f"calibrated-model {self.family}, seed {self.seed} (benchmark only)"

    def begin_request(self, index: int, rows: int = 0, requests: int = 1) -> None:
        """Route untagged forwards as request `index` (domain index % 2); `rows` positions
        of requests index .. index+requests-1 are drawn now, so a measured generation
        does not pay for them."""
        self.request = index
        if rows:
            for r in range(index, index + requests):
                self._rows(rows, r)

    def _rows(self, end: int, request: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        request = self.request if request is None else request
        table = self._tables.get(request)
        if table is None or len(table[0]) < end:
            n = max(MIN_ROWS, 1 << max(end - 1, 1).bit_length())
            rng = np.random.default_rng([self.seed, request, 0x0DE])
            ids, gates = self.model.tokens(request % DOMAINS, n, rng, gate=True,
                                           gate_ranks=GATE_RANKS_PER_K * self.model.shape.top_k)
            assert gates is not None
            table = self._tables[request] = (ids, gates)
        return table

    def ids(self, layer: int, start: int, count: int, request: int | None = None) -> np.ndarray:
        """int32 [count, top_k]: MoE layer `layer` (0-based) at positions start.. of
        `request` (default: the current one)."""
        return self._rows(start + count, request)[0][start : start + count, layer]

    def gate(self, layer: int, start: int, count: int, request: int | None = None) -> np.ndarray:
        """The emulated gate-ahead's prediction of MoE layer `layer` (>= 1) from layer-1."""
        return self._rows(start + count, request)[1][start : start + count, layer]
