"""The prefetch actor: learns from each layer's routing and orders the reads it predicts.

A trio task of its own. Compute sends it one event per MoE layer as soon as that layer's
routing is known (and a `TokenStart` per forward); it runs the strategy (observe, then
predict), scores the predictions against the true routing, records the routing trace,
and sends the predicted experts to the router as a prefetch order. Compute meanwhile
runs the layer on the MLX thread: prediction is off its critical path.

Order is what makes a run replayable, so compute waits (`caught_up`) for the event of
layer l to be handled before it demands layer l+1: the router then always sees
demand(l), prefetch(predicted at l), demand(l+1), as `moestream replay` does.

Gate strategies (`next-gate`, `lookahead`, a `combined` holding one) need the model's
routers and the layer's hidden state; compute evaluates their prediction in the same
MLX call as the routing and sends it along (`predicted`), so no host round trip is
added for them either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import trio

from actors import timeline
from actors.prefetch.scorer import PrefetchScorer
from actors.prefetch.strategies import Prediction, PrefetchStrategy, as_prediction
from actors.router import ExpertRouter
from actors.routing_trace import TraceRecorder

Phase = Literal["prefill", "decode"]


@dataclass
class TokenStart:
    phase: Phase


@dataclass
class Routed:
    """Layer `layer`'s true routing for one forward (rows: one per token)."""

    layer: int
    rows: np.ndarray  # [tokens, top_k] expert ids, as the router chose them
    ids: list[int]  # the layer's experts, each once, in the router's order
    tick: int
    phase: Phase
    predicted: Prediction | None = None  # None: the strategy predicts here
    predict: bool = True  # False: a layer that ran ahead with every expert present
    ordered: bool = False  # compute already ordered `predicted` with the layer's demand


class Prefetcher:
    def __init__(
        self,
        strategy: PrefetchStrategy,
        scorer: PrefetchScorer,
        router: ExpertRouter,
        recorder: TraceRecorder | None = None,
        *,
        gate: bool = False,
    ) -> None:
        self.strategy = strategy
        self.scorer = scorer
        self.router = router
        self.recorder = recorder
        self.gate = gate  # compute predicts (on the MLX thread); this task applies it
        # A list: the layers of a token that ran ahead, in order (one wake-up, not 40).
        self._send, self._receive = trio.open_memory_channel[TokenStart | Routed | list[Routed]](64)
        self._handled = 0  # events handled so far
        self._sent = 0
        self._progress = trio.Event()

    async def run(self) -> None:
        async with self._receive:
            async for event in self._receive:
                with timeline.span("prefetcher", type(event).__name__):
                    await self._handle(event)
                self._handled += 1
                self._progress.set()
                self._progress = trio.Event()

    async def send(self, event: TokenStart | Routed | list[Routed]) -> None:
        await self._send.send(event)
        self._sent += 1  # only once it is in the channel: a cancelled send sent nothing

    async def caught_up(self) -> None:
        """Wait until every event sent so far is handled (its prefetch order is queued)."""
        while self._handled < self._sent:
            await self._progress.wait()

    async def _handle(self, event: TokenStart | Routed | list[Routed]) -> None:
        if isinstance(event, list):
            for routed in event:
                await self._handle(routed)
            return
        if isinstance(event, TokenStart):
            if self.recorder is not None:
                self.recorder.begin_token(event.phase)
            if event.phase == "decode":
                self.scorer.begin_token()
            return
        if not self.gate:
            for row in event.rows:
                self.strategy.observe(event.layer, [int(e) for e in row])
        preds: Prediction = []
        if event.predicted is not None:
            preds = event.predicted
        elif event.predict and event.phase == "decode" and not self.gate:
            chosen = [int(e) for e in event.rows[0]]
            preds = as_prediction(self.strategy.predict(event.layer, chosen, None))
        if event.phase == "decode":
            self.scorer.score(event.layer, event.ids)
            self.scorer.record(preds)
        if not event.ordered:
            await self.router.prefetch(preds, event.tick)
        if self.recorder is not None:
            self.recorder.record(event.layer, event.ids, preds, tokens=event.rows)

