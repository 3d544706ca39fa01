"""Benchmark-only routing: the forward pass routes by the calibrated routing model.

A random-weight container's router is nearly uniform, so `moestream bench` on it measures
a worst case for the pool. With a `RoutingOverride` set on a `StreamedModel`, each MoE
layer's top-k ids come from the routing model's trace for (request, token position,
layer) instead of the router's argmax; the weights of those experts are still the
router's real softmax at those ids (normalized as the model does), so every read and
every matmul is the real one, only *which* experts is changed. The position is the
sequence's KV offset, and each sequence is tagged with its request when its caches are
made (a decode batch routes each row as its own request), so the routing is a function
of the token's place in its request alone: a miss redone layer by layer, a pipelined
step undone and redone, any pool size and any prefetch strategy give the same ids,
hence the same logits.

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


class Routed(list[Any]):
    """A sequence's caches (one per layer), or a decode batch's, tagged with the
    calibrated request each row routes as (`RoutingOverride.tag`; the batch cache
    operations carry the tags through merge, extend, keep and extract)."""

    requests: list[int | None]


def requests_of(cache: Sequence[Any]) -> list[int | None] | None:
    """The rows' requests of a tagged cache, else None."""
    return list(cache.requests) if isinstance(cache, Routed) else None


def tagged(cache: list[Any], requests: Sequence[int | None] | None) -> list[Any]:
    """`cache` tagged with `requests` (one per row); untagged when there are none."""
    if requests is None or all(r is None for r in requests):
        return cache
    out = Routed(cache)
    out.requests = list(requests)
    return out


def positions(cache: Sequence[Any]) -> list[int]:
    """Tokens already in each row of the sequence (or batch): the first KV cache's offset
    (0 without one). A `BatchKVCache` left-pads its rows: row r holds `_idx -
    left_padding[r]` tokens (its padding changes only between steps, when the batch
    regroups, so this costs no sync of the step in flight)."""
    for c in cache:
        if hasattr(c, "left_padding") and hasattr(c, "_idx"):
            return [int(c._idx) - p for p in c.left_padding.tolist()]
        if hasattr(c, "offset"):
            return [int(c.offset)]
    return [0]


class RoutingOverride:
    """Calibrated ids for the MoE layers `moe_layers` (model layer indices, in order)."""

    def __init__(self, source: CalibratedSource, moe_layers: Sequence[int], *,
                 emulate_gate: bool = False) -> None:
        self.source = source
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.emulate_gate = emulate_gate
        self.num_experts = source.model.shape.num_experts
        self._next = 0  # the request the next new sequence routes as
        # (layer, positions, requests, tokens) of the latest routed steps, for the gate: two
        # steps routed in lockstep (actors/pair_step.py: a verify pass and the token after
        # it, a prompt's last chunk and its last token) route the same layer one after the
        # other, and their hidden states reach the gate as one [rows, H], in that order.
        self._calls: list[tuple[int, list[int], list[int | None], int]] = []

    @property
    def label(self) -> str:
        gate = ", emulated gate" if self.emulate_gate else ""
        return self.source.label + gate

    def begin_request(self, index: int, rows: int = 0, requests: int = 1) -> None:
        """The next new sequence routes as request `index`, the one after as index+1, ...
        (`rows` positions of `requests` of them drawn now); untagged caches (a prefix
        cache restore) route as `index`."""
        self._next = index
        self.source.begin_request(index, rows, requests)

    def tag(self, cache: list[Any]) -> list[Any]:
        """A new sequence's caches, tagged with the next request (StreamedModel.make_cache)."""
        out = tagged(cache, [self._next])
        self._next += 1
        return out

    def where(self, cache: Sequence[Any]) -> tuple[list[int], list[int | None]]:
        """Each row's position and request, before a step's tokens."""
        pos = positions(cache)
        return pos, requests_of(cache) or [None] * len(pos)

    def ids(self, layer: int, where: tuple[list[int], list[int | None]], count: int) -> mx.array:
        """uint32 [rows, count, k] (the router's argpartition dtype) for `layer`: row r at
        positions pos[r].. of its request."""
        pos, requests = where
        self._calls.append((layer, pos, requests, count))
        del self._calls[:-8]
        rows = [self.source.ids(self.row[layer], p, count, r) for p, r in zip(pos, requests, strict=True)]
        return mx.array(np.stack(rows).astype(np.uint32))

    def gate_logits(self, layer: int, hidden: mx.array) -> mx.array:
        """Stand-in for layer `layer`'s router applied to `hidden` [rows * T, H]: [rows * T,
        experts] logits ranking the emulated gate's prediction first, for the latest routed
        step, or the steps routed in lockstep whose rows `hidden` holds (gate strategies
        predict right after the routing, on the same thread)."""
        t = hidden.shape[0] if hidden.ndim == 2 else 1
        steps: list[np.ndarray] = []
        n = 0
        source = self._calls[-1][0] if self._calls else None
        for routed, pos, requests, count in reversed(self._calls):
            if routed != source or n >= t:
                break
            steps.append(np.concatenate([self.source.gate(self.row[layer], p, count, r)
                                         for p, r in zip(pos, requests, strict=True)]))
            n += len(pos) * count
        if not steps:
            steps = [self.source.gate(self.row[layer], 0, 1, None)]
        rows = np.concatenate(steps[::-1])[-t:]
        k = rows.shape[1]
        out = np.zeros((len(rows), self.num_experts), dtype=np.float32)
        out[np.arange(len(rows))[:, None], rows] = np.arange(k, 0, -1, dtype=np.float32)
        return mx.array(out)
