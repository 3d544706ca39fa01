"""One verify pass through the compute actor: [last token, d1 .. dk] as one forward.

Like a decode token it runs ahead (one host sync for the whole pass, every position's
logits) when the policy expects the experts resident, and falls back to one sync per
MoE layer from the first layer that missed. Either way each MoE layer demands the union
of the pass's positions' experts once (`Compute.account` / `Compute.layered`), so an
expert several positions route to is read and pinned once for the pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from actors.compute import Compute
from actors.forward import ForwardStepper


class VerifyStepper(ForwardStepper, Protocol):
    positions: int

    def keep(self, n: int) -> None: ...


# (tokens, cache) -> a pass over them; the model's own (pipeline/models/verify_step.py).
MakeVerifyStep = Callable[[list[int], list[Any]], VerifyStepper]


def _start(c: Compute, make: MakeVerifyStep, tokens: list[int],
           cache: list[Any]) -> tuple[VerifyStepper, Any, Any]:
    step = make(tokens, cache)
    routing = step.run_to_routing(c._presync("decode"))
    return step, routing, c._learn(routing, "decode")


def _run_ahead(c: Compute, make: MakeVerifyStep, tokens: list[int],
               cache: list[Any]) -> tuple[VerifyStepper, Any]:
    step = make(tokens, cache)
    return step, step.run_ahead(c._slot_map())


async def verify_pass(c: Compute, make: MakeVerifyStep, tokens: list[int],
                      cache: list[Any]) -> tuple[mx.array, VerifyStepper]:
    """Every position's logits [len(tokens), vocab] (evaluated) and the pass (for `keep`)."""
    c.in_pass = True  # its gate predictions are cut to `c.pass_cap` (one forward at a time)
    try:
        return await _verify_pass(c, make, tokens, cache)
    finally:
        c.in_pass = False


async def _verify_pass(c: Compute, make: MakeVerifyStep, tokens: list[int],
                       cache: list[Any]) -> tuple[mx.array, VerifyStepper]:
    await c.begin_token("decode")
    misses0 = c.router.table.misses
    if c.run_ahead.wanted():
        c.stats.run_ahead_tokens += 1
        step, result = await c.on_mlx(_run_ahead, c, make, tokens, cache)
        miss = await c.account(result, "decode")
        c.run_ahead.after_run_ahead(hit=miss is None)
        if miss is None:
            return result.logits, step
        c.stats.run_ahead_misses += 1
        routing, preds = await c.on_mlx(c._resume, step, miss, "decode")
        return await c.layered(step, routing, preds, "decode", True), step
    step, routing, preds = await c.on_mlx(_start, c, make, tokens, cache)
    logits = await c.layered(step, routing, preds, "decode", True)
    c.run_ahead.after_layered(hit=c.router.table.misses == misses0)
    return logits, step
