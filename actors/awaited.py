"""A decode token queued whole, its MoE layers waiting on the GPU for the host's answers.

The host side of `actors/device_wait.py`. The MLX thread builds and evaluates the token
(`launch`: `ForwardStep.launch_with`, each layer's slots from a wait) while the compute
task (`Compute._queued_whole`) serves the layers as they are published: for each MoE layer
in order it reads the chosen ids and a gate strategy's ranking of the next layers
(`routed`), makes the demand the per-layer path makes (the pool, the prefetch orders and
`replay` see the same requests in the same order), and answers with the slots. Nothing on
that side touches MLX: the MLX thread is busy with the token until the last layer is
answered, so installs go off its thread meanwhile (`ExpertRouter.mlx_busy`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
import trio

from actors.device_wait import Mailboxes
from actors.prefetch.strategies import Prediction


class GateRanking(Protocol):
    """A gate strategy that can publish its ranking from the GPU (actors/prefetch/gate.py)."""

    def ranking(self, layer: int, hidden: mx.array) -> mx.array | None: ...

    def predict_ranked(self, layer: int, ranked: np.ndarray) -> Prediction: ...

    def observe(self, layer: int, chosen: Sequence[int]) -> None: ...


def usable(strategy: Any) -> bool:
    """Whether a prefetch strategy works with tokens queued whole: one that predicts in
    the prefetch task, or a gate that can publish its ranking from the GPU."""
    return not getattr(strategy, "needs_model", False) or hasattr(strategy, "predict_ranked")


def one_row(tokens: Any) -> bool:
    """A lone sequence's decode token (a batch's rows keep the per-layer path)."""
    if isinstance(tokens, mx.array):
        return tokens.size == 1
    return len(tokens) == 1 and (isinstance(tokens[0], int) or len(tokens[0]) == 1)


def launch(wait: Mailboxes, seq: int, make_step: Callable[[], Any], rows: dict[int, int],
           gate: GateRanking | None) -> tuple[Any, Any]:
    """On the MLX thread: build the token (`make_step()`), each MoE layer's slots from its
    wait, and evaluate it: returns once every layer ran (step, run-ahead result)."""
    step = make_step()

    def lookup(layer: int, ids: mx.array, hidden: mx.array) -> mx.array:
        extra = gate.ranking(layer, hidden) if gate is not None else None
        return wait.wait_slots(rows[layer], seq, ids, extra)

    lazy = step.launch_with(lookup)
    mx.eval(lazy.arrays())
    return step, lazy.result()


async def published(wait: Mailboxes, row: int, seq: int) -> bool:
    """Wait for layer `row` of token `seq` to be published; False if the token was given up."""
    while not wait.published(row, seq):
        if wait.aborted(seq):
            return False
        await trio.sleep(0)  # a checkpoint: the router, prefetch and readers run
    return True


def routed(wait: Mailboxes, row: int, layer: int,
           gate: GateRanking | None) -> tuple[np.ndarray, list[int], Prediction | None]:
    """A published layer: its ids as rows (one token), each expert once in order, and the
    gate's prediction for the next layers (None: the prefetch task predicts)."""
    ids, ranked = wait.routed(row)
    chosen = [int(e) for e in ids]  # one token of one sequence (`one_row`)
    if gate is None:
        return ids.reshape(1, -1), list(dict.fromkeys(chosen)), None
    gate.observe(layer, chosen)
    return ids.reshape(1, -1), list(dict.fromkeys(chosen)), gate.predict_ranked(layer, ranked)
