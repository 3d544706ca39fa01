"""A decode token queued whole, its MoE layers waiting on the GPU for the host's answers.

The host side of `actors/device_wait.py`. The MLX thread builds and evaluates the token
(`ForwardStep.launch_with`, each layer's slots from a wait kernel) while the compute
task, here, serves the layers as the GPU publishes them: for each MoE layer in order it
reads the chosen ids (and a gate strategy's ranking of the next layers), makes the same
demand the per-layer path makes (`Compute._demand`: the pool, the prefetch orders and
`replay` see the same requests in the same order), and answers with the slots. Nothing
here touches MLX: the MLX thread is busy with the token until the last layer is
answered, so installs go by DMA off its thread (`ExpertRouter.mlx_busy`).

The token's result is a run-ahead's: logits, ids, and a layer whose slots came back -1
(the host gave the token up, or a wait timed out) is redone from there, layer by layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import trio

from actors import timeline
from actors.device_wait import Mailboxes
from actors.prefetch.actor import Routed

if TYPE_CHECKING:
    from actors.compute import Compute, Tokens


def usable(strategy: Any) -> bool:
    """Whether a prefetch strategy works with tokens queued whole: one that predicts in
    the prefetch task, or a gate that can publish its ranking from the GPU."""
    return not getattr(strategy, "needs_model", False) or hasattr(strategy, "predict_ranked")


def one_row(tokens: Tokens) -> bool:
    """A lone sequence's decode token (a batch's rows keep the per-layer path)."""
    if isinstance(tokens, mx.array):
        return tokens.size == 1
    return len(tokens) == 1 and (isinstance(tokens[0], int) or len(tokens[0]) == 1)


def _launch(c: Compute, wait: Mailboxes, seq: int, tokens: Tokens, cache: list[Any]) -> tuple[Any, Any]:
    """On the MLX thread: build the token, evaluate it (returns once every layer ran)."""
    from actors.compute import _ids

    step = c.model.step(_ids(tokens), cache)
    gate = c.strategy if c._gate else None

    def lookup(layer: int, ids: mx.array, hidden: mx.array) -> mx.array:
        extra = gate.ranking(layer, hidden) if gate is not None else None  # type: ignore[attr-defined]
        return wait.wait_slots(c.layer_rows[layer], seq, ids, extra)

    lazy = step.launch_with(lookup)  # type: ignore[attr-defined]
    mx.eval(lazy.arrays())
    return step, lazy.result()


async def _serve(c: Compute, wait: Mailboxes, seq: int, layers: list[int]) -> None:
    """Answer each MoE layer as the GPU publishes it; return early if the GPU gave up."""
    for row, layer in enumerate(layers):
        while not wait.published(row, seq):
            if wait.aborted(seq):
                return
            await trio.sleep(0)  # a checkpoint: the router, prefetch and readers run
        ids, ranked = wait.routed(row)
        rows = ids.reshape(1, -1)  # one token of one sequence (`one_row`)
        preds = None
        if c._gate:
            for chosen in rows:
                c.strategy.observe(layer, [int(e) for e in chosen])
            preds = c.strategy.predict_ranked(layer, ranked)  # type: ignore[attr-defined]
        c.tick += 1
        with timeline.span("compute", "answer", layer=layer):
            slot_of = await c._demand(Routed(layer, rows, list(dict.fromkeys(int(e) for e in ids)),
                                             c.tick, "decode", predicted=preds))
        wait.answer(row, seq, slot_of[ids].astype(np.int32))


async def forward(c: Compute, wait: Mailboxes, tokens: Tokens, cache: list[Any]) -> mx.array:
    """One decode token queued whole; its logits (redone per layer from a layer given up)."""
    seq = wait.next_seq()
    layers = list(c.layer_rows)
    misses0 = c.router.table.misses
    done: list[tuple[Any, Any]] = []

    async def run_token() -> None:
        done.append(await c.on_mlx(_launch, c, wait, seq, tokens, cache))

    c.stats.awaited_tokens += 1
    c.router.landing_safe = c.router.mlx_busy = True
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_token)
            try:
                await _serve(c, wait, seq, layers)
            except BaseException:
                wait.abort(seq)  # the GPU stops waiting; the MLX call then returns
                raise
    finally:
        c.router.landing_safe = c.router.mlx_busy = False
    step, result = done[0]
    miss = result.first_miss()
    if miss is None:
        c.run_ahead.after_layered(hit=c.router.table.misses == misses0)
        return result.logits
    c.stats.awaited_given_up += 1
    return await c.finish_from(step, miss, "decode")
