"""Benchmark-only routing: the forward pass routes by the calibrated routing model.

A random-weight container's router is nearly uniform, so `moestream bench` on it measures
a worst case for the pool. With a `RoutingOverride` set on a `StreamedModel`, each MoE
layer's top-k ids come from the routing model's trace for (request, token position,
layer) instead of the router's argmax; the weights of those experts are still the
router's real softmax at those ids (normalized as the model does), so every read and
every matmul is the real one, only *which* experts is changed. The position is the
sequence's KV offset, so the routing is a function of the token's place in its request
alone: a miss redone layer by layer, a pipelined step undone and redone, any pool size
and any prefetch strategy give the same ids, hence the same logits.

Next-gate under an override: the real routers see the model's hidden state, which no
longer decides the routing, so its accuracy is honest but poor (it predicts the random
router, not the injected ids). `emulate_gate=True` replaces the routers seen by gate
strategies with the routing model's emulated gate-ahead (layer l+1's noiseless logits
plus noise, fitted to the published ~46 % recall): what a trained model's gate would
predict, for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from actors.routing_model.source import CalibratedSource


def position(cache: Sequence[Any]) -> int:
    """Tokens already in the sequence: the first KV cache's offset (0 without one)."""
    return next((int(c.offset) for c in cache if hasattr(c, "offset")), 0)


class RoutingOverride:
    """Calibrated ids for the MoE layers `moe_layers` (model layer indices, in order)."""

    def __init__(self, source: CalibratedSource, moe_layers: Sequence[int], *,
                 emulate_gate: bool = False) -> None:
        self.source = source
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.emulate_gate = emulate_gate
        self.num_experts = source.model.shape.num_experts
        self._last = (0, 1)  # (position, tokens) of the latest routed step, for the gate

    @property
    def label(self) -> str:
        gate = ", emulated gate" if self.emulate_gate else ""
        return self.source.label + gate

    def begin_request(self, index: int, rows: int = 0) -> None:
        self.source.begin_request(index, rows)

    def ids(self, layer: int, start: int, count: int) -> mx.array:
        """uint32 [1, count, k] (the router's argpartition dtype) for `layer` at start.. ."""
        self._last = (start, count)
        rows = self.source.ids(self.row[layer], start, count)
        return mx.array(rows.astype(np.uint32))[None]

    def gate_logits(self, layer: int, hidden: mx.array) -> mx.array:
        """Stand-in for layer `layer`'s router applied to `hidden` [T, H]: [T, experts]
        logits ranking the emulated gate's prediction first, for the latest routed step
        (gate strategies predict right after that step's routing, on the same thread)."""
        start, count = self._last
        t = hidden.shape[0] if hidden.ndim == 2 else 1
        rows = self.source.gate(self.row[layer], start, count)[-t:]
        k = rows.shape[1]
        out = np.zeros((len(rows), self.num_experts), dtype=np.float32)
        out[np.arange(len(rows))[:, None], rows] = np.arange(k, 0, -1, dtype=np.float32)
        return mx.array(out)
