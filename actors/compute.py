"""The compute actor: drives one forward call layer by layer on the MLX thread.

Per MoE layer it makes one MLX call that computes the previous layer's routed experts,
runs the dense work up to this layer's router and syncs the top-k ids; gate-based
prefetch strategies stage their prediction into that same sync, so prediction costs no
extra host round trip. Between those calls the trio side asks the router for the slots
(the only place compute can wait on I/O; the router installs the blobs that have landed)
and queues the prefetch reads, which then overlap the next MLX call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from actors import timeline
from actors.forward import ForwardStepper, Presync, Routing, SteppedModel
from actors.mlx_worker import MlxWorker
from actors.prefetch import PrefetchScorer, PrefetchStrategy
from actors.router import ExpertRouter
from actors.routing_trace import TraceRecorder

Phase = Literal["prefill", "decode"]
Predictions = list[tuple[int, list[int]]]


@dataclass
class ComputeStats:
    mlx_seconds: float = 0.0


def unique_in_order(ids: np.ndarray) -> list[int]:
    """Experts a layer needs, each once, in the order the router first chose them."""
    return list(dict.fromkeys(int(e) for e in ids.reshape(-1)))


class Compute:
    def __init__(
        self,
        worker: MlxWorker,
        model: SteppedModel,
        router: ExpertRouter,
        strategy: PrefetchStrategy,
        scorer: PrefetchScorer,
        recorder: TraceRecorder | None = None,
    ) -> None:
        self.worker = worker
        self.model = model
        self.router = router
        self.strategy = strategy
        self.scorer = scorer
        self.recorder = recorder
        self.tick = 0
        self.stats = ComputeStats()

    def _learn(self, routing: Routing | None, phase: Phase) -> Predictions:
        """On the MLX thread, straight after a routing sync: observe, then predict."""
        if routing is None:
            return []
        for row in routing.ids:
            self.strategy.observe(routing.layer, [int(e) for e in row])
        if phase != "decode":
            return []
        chosen = [int(e) for e in routing.ids[0]]
        preds = self.strategy.predict(routing.layer, chosen, routing.hidden)
        return [(int(layer), [int(e) for e in ids]) for layer, ids in preds]

    def _presync(self, phase: Phase) -> Presync | None:
        # Gate strategies stage their prediction so it is evaluated with the routing.
        return getattr(self.strategy, "prepare", None) if phase == "decode" else None

    def _start(
        self, tokens: Sequence[int], cache: list[Any], phase: Phase
    ) -> tuple[ForwardStepper, Routing | None, Predictions]:
        step = self.model.step(list(tokens), cache)
        routing = step.run_to_routing(self._presync(phase))
        return step, routing, self._learn(routing, phase)

    def _advance(
        self, step: ForwardStepper, slot_of: np.ndarray, phase: Phase
    ) -> tuple[Routing | None, Predictions]:
        routing = step.advance(slot_of, self._presync(phase))
        return routing, self._learn(routing, phase)

    async def _mlx(self, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            with timeline.span("compute", getattr(fn, "__name__", "mlx")):
                return await self.worker.run(fn, *args)
        finally:
            self.stats.mlx_seconds += time.perf_counter() - start

    async def forward(self, tokens: Sequence[int], cache: list[Any], phase: Phase) -> mx.array:
        """Run `tokens` through the model (updating `cache`); the last position's logits."""
        if self.recorder is not None:
            self.recorder.begin_token(phase)
        if phase == "decode":
            self.scorer.begin_token()
        step, routing, preds = await self._mlx(self._start, tokens, cache, phase)
        while routing is not None:
            self.tick += 1
            ids = unique_in_order(routing.ids)
            if phase == "decode":
                self.scorer.score(routing.layer, ids)
                self.scorer.record(preds)
            slot_of = await self.router.demand(routing.layer, ids, self.tick)
            self.router.prefetch(preds, self.tick)
            if self.recorder is not None:
                self.recorder.record(routing.layer, ids, preds, tokens=routing.ids)
            routing, preds = await self._mlx(self._advance, step, slot_of, phase)
        return await self._mlx(step.logits)
