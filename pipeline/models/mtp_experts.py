"""The MTP head's forward with its routed experts from a pool of their own.

`HeadStep` splits the head's forward where the main model's `ForwardStep` splits a
layer's: fc and attention, then the router's top-k ids (one sync); the caller makes
those experts resident (`HeadPool.demand`, reads through the engine's reader); then the
routed experts over pool slots (`routed_experts`, the kernels the model's layers use),
the shared expert and the final norm. Same ops in the same order as the resident head
(mlx-lm's layer), so the same bits.

A forward over more positions than the pool has slots for their experts (the head's
catch-up over a prompt) computes the routed experts in rounds: each round pins as many
experts as fit, computes every (position, choice) pair over them and keeps the pairs
whose expert it held (`mx.where`). A pair's result does not depend on the others in
the call (one row times one expert's matrices; checked bit for bit in tests/test_mtp.py),
so any number of rounds gives the resident head's bits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import mlx.core as mx
import numpy as np

from actors.forward import unique_in_order
from actors.pool.head_pool import HeadPool
from actors.pool.storage import PoolStorage
from pipeline.models.families.base import ForwardFamily
from pipeline.models.moe import routed_experts
from pipeline.models.mtp import MtpHead

OnMlx = Callable[..., Awaitable[Any]]


class HeadStep:
    """One forward of the head (on the MLX thread); `ids`: the experts it routes to."""

    def __init__(self, head: MtpHead, family: ForwardFamily, embeds: mx.array, hidden: mx.array,
                 cache: Any, last_only: bool = False) -> None:
        self.head, self.family = head, family
        layer = head.layer
        self.h_mid = head.attend(embeds, hidden, cache, last_only)
        self.x = layer.post_attention_layernorm(self.h_mid)
        self.inds, self.scores = family.route(layer.mlp, self.x)
        mx.eval(self.inds)
        self.ids = unique_in_order(np.asarray(self.inds))
        self.routed: mx.array | None = None

    def add(self, arrays: dict[str, mx.array], fmt: Any, slot_of: np.ndarray) -> None:
        """One round: the pairs whose expert `slot_of` holds (-1: not this round),
        evaluated before the pool's slots change again."""
        slots = mx.array(slot_of.astype(np.int32))[self.inds]
        out = routed_experts(arrays, fmt, self.x, mx.maximum(slots, 0), self.family.activation)
        self.routed = out if self.routed is None else mx.where((slots >= 0)[..., None], out, self.routed)
        mx.eval(self.routed)

    def finish(self) -> mx.array:
        """The head's normed output [1, T, H] (lazy)."""
        assert self.routed is not None
        mlp = self.head.layer.mlp
        return self.head.norm(self.h_mid + self.family.moe_output(mlp, self.x, self.routed, self.scores))


class StreamedExperts:
    """The head's routed experts: its pool and that pool's storage."""

    def __init__(self, pool: HeadPool, storage: PoolStorage, family: ForwardFamily) -> None:
        self.pool, self.storage, self.family = pool, storage, family

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    async def forward(self, head: MtpHead, embeds: mx.array, hidden: mx.array, cache: Any,
                      on_mlx: OnMlx, last_only: bool = False) -> mx.array:
        """What `head(embeds, hidden, cache, last_only)` computes, its experts read as needed."""
        step: HeadStep = await on_mlx(HeadStep, head, self.family, embeds, hidden, cache, last_only)
        arrays, fmt, _ = self.storage.view(self.pool.layer)  # one bank: its own small pool
        n = self.pool.num_slots
        async with self.pool.lock:
            try:
                for start in range(0, len(step.ids), n):
                    slot_of = await self.pool.demand(step.ids[start : start + n])
                    await on_mlx(step.add, arrays, fmt, slot_of)
            finally:
                self.pool.release()
        return await on_mlx(step.finish)
