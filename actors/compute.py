"""The compute actor: drives forward passes on the MLX thread.

Two ways through a forward. Run-ahead (decode, experts expected resident): the whole
token is one MLX evaluation with a device-side expert -> slot map, one host sync; a
layer that missed is redone from there. Per layer (prefill, and decode when misses are
likely): one MLX call per MoE layer computes the previous layer's routed experts, runs
the dense work up to this layer's router and syncs the top-k ids (gate prefetch
strategies stage their prediction into that same sync). Between those calls compute
asks the router actor for the slots (the only place it can wait on I/O) and hands the
routing to the prefetch actor, whose orders then overlap the next MLX call.

The generation that runs these forwards is itself a job of the compute task
(`actors/compute_task.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
import numpy as np

from actors import awaited, timeline
from actors.device_wait import Mailboxes
from actors.forward import ForwardStepper, Presync, Routing, SteppedModel, unique_in_order
from actors.mlx_worker import MlxWorker
from actors.pair_step import PairStep
from actors.prefetch import PrefetchScorer, PrefetchStrategy
from actors.prefetch.actor import Prefetcher, Routed, TokenStart
from actors.prefetch.strategies import as_prediction
from actors.router import ExpertRouter
from actors.routing_trace import TraceRecorder
from actors.run_ahead import RunAheadPolicy
from actors.slot_map import SlotMap, snapshot

Phase = Literal["prefill", "decode"]
Predictions = list[tuple[int, list[int]]]
# One sequence's ids, or a batch's [rows, tokens] (nested lists, or an array).
Tokens = Sequence[int] | Sequence[Sequence[int]] | mx.array


def _ids(tokens: Tokens) -> list[int] | mx.array:
    """On the MLX thread (arrays are made where they are used)."""
    if isinstance(tokens, mx.array):
        return tokens
    # `Tokens` is one sequence's ids or a batch's rows of them; the first item says which
    # (the checker cannot narrow a sequence by its first item, hence the two ignores).
    if tokens and not isinstance(tokens[0], int):
        return mx.array([list(row) for row in tokens])  # type: ignore[arg-type]
    return list(tokens)  # type: ignore[arg-type]


def _count(tokens: Tokens) -> int:
    """Tokens per row: a prompt chunk's length (a batch's [rows, tokens] too)."""
    if isinstance(tokens, mx.array):
        return int(tokens.shape[-1])
    if tokens and not isinstance(tokens[0], int):
        return len(tokens[0])
    return len(tokens)


@dataclass
class ComputeStats:
    mlx_seconds: float = 0.0
    run_ahead_tokens: int = 0  # decode tokens that tried the one-sync path
    run_ahead_misses: int = 0  # ... and fell back at their first missing layer
    ahead_steps: int = 0  # decode steps queued second, while the host did the last token's bookkeeping
    paired_prompts: int = 0  # prompts whose last chunk and last token stepped together
    awaited_tokens: int = 0  # decode tokens queued whole, waiting on the GPU for reads
    awaited_given_up: int = 0  # ... redone per layer from a layer the wait gave up
    awaited_layers: int = 0  # ... their MoE layers answered, and the host's time for them
    awaited_host_seconds: float = 0.0  # (from seeing a layer published to its answer)
    # From a layer's answer to seeing the next layer published: the GPU's work between
    # (~0.55 ms a layer for the 35B on the H200) and the host's delay in noticing.
    awaited_gap_seconds: float = 0.0
    # ... of which the GPU's own (its clock: a layer's kernel end to the next one's
    # publication) and its copies after an answer (answer seen to kernel end).
    awaited_gpu_gap_seconds: float = 0.0
    awaited_tail_seconds: float = 0.0
    # ... and the host's: from the answer to the compute task's first look at the next
    # layer (the event loop's other work meanwhile), and from the last look that found it
    # unpublished to the one that found it (the polling's granularity, an upper bound).
    awaited_back_seconds: float = 0.0
    awaited_poll_seconds: float = 0.0
    # The GPU's side of an answer (its clock): its last look that found none to the one
    # that found it.
    awaited_gpu_look_seconds: float = 0.0
    # Layers whose every routed expert was already installed (or listed for the GPU) when
    # the host saw them published: those a GPU need not have waited for at all.
    awaited_ready_layers: int = 0


class Compute:
    def __init__(
        self,
        worker: MlxWorker,
        model: SteppedModel,
        router: ExpertRouter,
        strategy: PrefetchStrategy,
        scorer: PrefetchScorer,
        recorder: TraceRecorder | None = None,
        *,
        moe_layers: Sequence[int] = (),
        run_ahead: RunAheadPolicy | None = None,
        decode_ahead: bool = True,
        pass_cap: int | None = None,
    ) -> None:
        self.worker = worker
        self.model = model
        self.router = router
        self.strategy = strategy
        self.scorer = scorer
        self.recorder = recorder
        self.tick = 0
        self.stats = ComputeStats()
        self.run_ahead = run_ahead or RunAheadPolicy("off")
        # A lone row's decode may queue a second step where every expert is ready
        # (actors/decode.py); `compute.decode_ahead`.
        self.decode_ahead = decode_ahead
        # A verify pass's gate predictions cut to this many a layer (`prefetch.
        # pass_max_per_layer`); `in_pass` while one runs (actors/speculative/verify.py).
        self.pass_cap = pass_cap
        self.in_pass = False
        # Called with the phase as each forward starts (a benchmark splits prefill from
        # decode there); the engine adds and removes them (`Engine.watch_tokens`).
        self.token_hooks: list[Callable[[Phase], None]] = []
        self._row_of = {layer: i for i, layer in enumerate(moe_layers)}
        # Decode tokens queued whole, the GPU waiting for their reads (actors/awaited.py):
        # set by the engine where the probe passed (CUDA's direct path) or emulated.
        self.device_wait: Mailboxes | None = None
        self._map: SlotMap | None = None
        # Strategies that read the model (next-gate, lookahead, a combination holding one)
        # predict on the MLX thread, in the routing's own sync; the others in the
        # prefetch task.
        self._gate = bool(getattr(strategy, "needs_model", False))
        self.prefetcher = Prefetcher(strategy, scorer, router, recorder, gate=self._gate)

    @property
    def gate_ranking(self) -> awaited.GateRanking | None:
        """The strategy, where it predicts on the MLX thread from the model's gates."""
        return cast(awaited.GateRanking, self.strategy) if self._gate else None

    @property
    def layer_rows(self) -> dict[int, int]:
        """MoE layer -> its row (0, 1, ...): the slot map's and the device wait's."""
        return self._row_of

    def _learn(self, routing: Routing | None, phase: Phase) -> Predictions | None:
        """Gate strategies, on the MLX thread right after a routing sync: observe, predict.

        None for the others: the prefetch actor runs them.
        """
        if routing is None or not self._gate:
            return None
        for row in routing.ids:
            self.strategy.observe(routing.layer, [int(e) for e in row])
        # Gate strategies predict in prefill too: from every token of the chunk, the next
        # layer's union (its reads then overlap this layer's compute).
        chosen = [int(e) for e in routing.ids[0]]
        preds = as_prediction(self.strategy.predict(routing.layer, chosen, routing.hidden))
        if self.in_pass and self.pass_cap:
            return [(target, ids[: self.pass_cap]) for target, ids in preds]
        return preds

    def _presync(self, phase: Phase) -> Presync | None:
        # Gate strategies stage their prediction so it is evaluated with the routing.
        return getattr(self.strategy, "prepare", None) if phase == "decode" else None

    def _start(
        self, tokens: Tokens, cache: list[Any], phase: Phase
    ) -> tuple[ForwardStepper, Routing | None, Predictions | None]:
        step = self.model.step(_ids(tokens), cache)
        return (step, *self._first_routing(step, phase))

    def _advance(
        self, step: ForwardStepper, slot_of: np.ndarray, phase: Phase
    ) -> tuple[Routing | None, Predictions | None]:
        routing = step.advance(slot_of, self._presync(phase))
        return routing, self._learn(routing, phase)

    async def on_mlx(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the MLX thread, timed as compute (the decoders' steps use it too)."""
        start = time.perf_counter()
        try:
            with timeline.span("compute", getattr(fn, "__name__", "mlx")):
                return await self.worker.run(fn, *args)
        finally:
            self.stats.mlx_seconds += time.perf_counter() - start

    def _slot_map(self) -> SlotMap:
        """The ready experts' slots for a run-ahead (rebuilt when the pool's table changes)."""
        table = self.router.table
        if self._map is None or self._map.version != table.version:
            self._map = snapshot(table, self._row_of, self.router.num_experts)
        return self._map

    def _run_ahead(self, tokens: Tokens, cache: list[Any]) -> tuple[ForwardStepper, Any]:
        step = self.model.step(_ids(tokens), cache)
        return step, step.run_ahead(self._slot_map())

    def _resume(
        self, step: ForwardStepper, layer: int, phase: Phase
    ) -> tuple[Routing | None, Predictions | None]:
        routing = step.resume(layer, self._presync(phase))
        return routing, self._learn(routing, phase)

    async def begin_token(self, phase: Phase) -> None:
        """Before a forward's bookkeeping: the recorder and the scorer start a token."""
        for hook in self.token_hooks:
            hook(phase)
        await self.prefetcher.send(TokenStart(phase))

    async def forward(self, tokens: Tokens, cache: list[Any], phase: Phase,
                      all_positions: bool = False) -> mx.array:
        """Run `tokens` through the model (updating `cache`); the last position's logits
        (every position's, [tokens, vocab], with `all_positions`: prefill only). A
        [rows, 1] array decodes a batch (merged caches): logits [rows, vocab].

        Decode tokens run ahead (one host sync for the whole token) when the policy
        expects every expert to be in the pool, and fall back to one sync per MoE layer
        from the first layer that missed; prefill always steps layer by layer.
        """
        await self.begin_token(phase)
        misses0 = self.router.table.misses
        ahead = phase == "decode" and not all_positions and self.run_ahead.wanted()
        if ahead:
            self.stats.run_ahead_tokens += 1
            step, result = await self.on_mlx(self._run_ahead, tokens, cache)
            miss = await self.account(result, phase)
            self.run_ahead.after_run_ahead(hit=miss is None)
            if miss is None:
                return result.logits
            return await self.finish_from(step, miss, phase)
        if (self.device_wait is not None and phase == "decode" and not all_positions
                and awaited.one_row(tokens)):
            return await awaited.queued_whole(
                self, self.device_wait, lambda: self.model.step(_ids(tokens), cache))
        # A prompt's chunk wants the disk's bandwidth: the reader's bulk lane reads too.
        with self.router.reader.bulk(phase == "prefill" and _count(tokens) > 1):
            step, routing, preds = await self.on_mlx(self._start, tokens, cache, phase)
            logits = await self.layered(step, routing, preds, phase, all_positions)
        # A prompt's last token runs alone, as a decode token does: whether it needed a
        # read says whether the first decode token may run ahead (a run-ahead that misses
        # costs its wasted layers and holds a snapshot of the model's state meanwhile).
        last_prompt_token = phase == "prefill" and isinstance(tokens, list) and len(tokens) == 1
        if phase == "decode" or last_prompt_token:
            self.run_ahead.after_layered(hit=self.router.table.misses == misses0)
        return logits

    async def forward_pair(self, tokens: list[int], last: int, cache: list[Any],
                           between: Callable[[int | None], None]) -> mx.array | None:
        """A prompt's last chunk `tokens` and its last token in one layer-by-layer pass
        (actors/pair_step.py; `between` as there): the last token's logits, the same as
        `forward(tokens)` then `forward([last])` give. None, with nothing run, where the
        model cannot pair them: the caller runs them one after the other."""
        pair = await self.on_mlx(self._pair, tokens, last, cache, between)
        if pair is None:
            return None
        self.stats.paired_prompts += 1
        await self.begin_token("prefill")
        misses0 = self.router.table.misses
        with self.router.reader.bulk():
            routing, preds = await self.on_mlx(self._first_routing, pair, "prefill")
            logits = await self.layered(pair, routing, preds, "prefill")
        # As after a prompt's last token run alone: whether the first decode token runs ahead.
        self.run_ahead.after_layered(hit=self.router.table.misses == misses0)
        return logits

    def _pair(self, tokens: list[int], last: int, cache: list[Any],
              between: Callable[[int | None], None]) -> PairStep | None:
        step_after = getattr(self.model, "step_after", None)
        second = step_after([last], cache, len(tokens)) if step_after is not None else None
        if second is None:
            return None
        return PairStep(self.model.step(tokens, cache), second, between)  # type: ignore[arg-type]

    def _first_routing(self, step: ForwardStepper, phase: Phase) -> tuple[Routing | None, Predictions | None]:
        routing = step.run_to_routing(self._presync(phase))
        return routing, self._learn(routing, phase)

    async def account(self, result: Any, phase: Phase) -> int | None:
        """Bookkeeping for a run-ahead's layers up to its first miss; that layer or None.

        The pool sees the same requests as on the per-layer path. Gate strategies cannot
        predict here (the run-ahead kept no routers' inputs) and need not (every expert
        was there): the layers' demands then go as one request. Statistics strategies
        predict and prefetch layer by layer as always, so `replay` reruns them exactly.
        """
        if result.slot_map is not None:  # the table may have moved under a queued step
            result.present = result.present & result.slot_map.held(self.router.table, result.layers, result.ids)
        miss = result.first_miss()
        done: list[tuple[int, list[int], int, np.ndarray]] = []
        for layer, rows, ok in zip(result.layers, result.ids, result.present, strict=True):
            if not ok:
                break
            self.tick += 1
            done.append((layer, unique_in_order(rows), self.tick, rows))
        if not done:
            return miss
        if self._gate or self.strategy.name == "none":
            await self.prefetcher.caught_up()
            await self.router.demand_all([(layer, ids, tick) for layer, ids, tick, _ in done])
            await self.prefetcher.send([Routed(layer, rows, ids, tick, phase, predicted=[], predict=False)
                                        for layer, ids, tick, rows in done])
            return miss
        for layer, ids, tick, rows in done:
            await self.demand_layer(Routed(layer, rows, ids, tick, phase))
        return miss

    async def demand_layer(self, routed: Routed, then: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """One MoE layer's demand, then its routing to the prefetch task.

        The prefetch orders of the layer before go first: a fixed order of requests at
        the router, the one `replay` reproduces. `then(slot_of)` runs as soon as the slots
        are known, before the prefetch task hears of the layer (a waiting GPU's answer).
        """
        await self.prefetcher.caught_up()
        if routed.predicted is not None:
            # A gate prediction is known already: ordered with the demand, before its wait.
            routed.ordered = True
        slot_of = await self.router.demand(routed.layer, routed.ids, routed.tick,
                                           routed.predicted if routed.ordered else None)
        if then is not None:
            then(slot_of)
        await self.prefetcher.send(routed)
        return slot_of

    async def finish_from(self, step: ForwardStepper, miss: int, phase: Phase) -> mx.array:
        """A run-ahead missed at layer `miss`: redo it from there, one sync per layer."""
        self.stats.run_ahead_misses += 1
        routing, preds = await self.on_mlx(self._resume, step, miss, phase)
        return await self.layered(step, routing, preds, phase)

    async def layered(
        self, step: ForwardStepper, routing: Routing | None, preds: Predictions | None,
        phase: Phase, all_positions: bool = False,
    ) -> mx.array:
        """Step the forward on, one MoE layer at a time: demand, prefetch, advance.

        Every caller enters after a routing sync with nothing else queued, and from here
        on each queued kernel reads only its layer's pinned experts: reads may land
        (actors/router.py). Cleared before any run-ahead can be queued again."""
        self.router.landing_safe = True
        try:
            while routing is not None:
                self.tick += 1
                ids = unique_in_order(routing.ids)
                slot_of = await self.demand_layer(
                    Routed(routing.layer, routing.ids, ids, self.tick, phase, predicted=preds)
                )
                routing, preds = await self.on_mlx(self._advance, step, slot_of, phase)
            return await self.on_mlx(step.logits, all_positions)
        finally:
            self.router.landing_safe = False
