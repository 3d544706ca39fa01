"""Prefetch strategies: predict which experts later MoE layers will route to.

Protocol, per token and per MoE layer l in order, right after l's true routing is known:
`observe(l, chosen)` (learn), then `predict(l, chosen, hidden)` -> [(layer_j, ids)] for
later MoE layers of the same token, ids most confident first. `reset_sequence()` starts a
new prompt. A wrong prediction costs bandwidth only: compute always uses the true routing.

Statistics-based strategies (`History`, `Transition`) are deterministic functions of the
routing they observed, so `moestream replay` reruns them exactly. Gate-based ones
(`NextGate` in actors/prefetch/gate.py) need the model; replay uses their recorded
predictions. Ties between equal scores go to the lower expert id.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx

Prediction = list[tuple[int, list[int]]]


def as_prediction(preds: Sequence[tuple[int, Sequence[int]]]) -> Prediction:
    """A strategy's output as plain ints (numpy scalars and MLX lists included)."""
    return [(int(layer), [int(e) for e in ids]) for layer, ids in preds]


@runtime_checkable
class PrefetchStrategy(Protocol):
    name: str

    def predict(self, layer: int, chosen: Sequence[int], hidden: mx.array | None) -> Prediction: ...

    def observe(self, layer: int, chosen: Sequence[int]) -> None: ...

    def reset_sequence(self) -> None: ...

    def params(self) -> dict[str, Any]: ...


class LayerOrder:
    """Successor lookups over the (sorted) MoE layer indices; do not assume all are MoE."""

    def __init__(self, moe_layers: Sequence[int]) -> None:
        layers = sorted(set(int(x) for x in moe_layers))
        if not layers:
            raise ValueError("prefetch: moe_layers is empty")
        self.layers = layers
        self._prev = {b: a for a, b in zip(layers, layers[1:], strict=False)}

    def after(self, layer: int, depth: int) -> list[int]:
        start = bisect.bisect_right(self.layers, layer)
        return self.layers[start : start + depth]

    def previous(self, layer: int) -> int | None:
        return self._prev.get(layer)


def top_ids(scores: np.ndarray, k: int) -> list[int]:
    """Up to k ids with positive score, best first, ties to the lower id."""
    order = np.argsort(-scores, kind="stable")[:k]
    return [int(i) for i in order if scores[i] > 0]


class NoPrefetch:
    name = "none"

    def predict(self, layer: int, chosen: Sequence[int], hidden: mx.array | None) -> Prediction:
        return []

    def observe(self, layer: int, chosen: Sequence[int]) -> None:
        pass

    def reset_sequence(self) -> None:
        pass

    def params(self) -> dict[str, Any]:
        return {}


class History:
    """Per-layer popularity with exponential decay (one decay step per observation)."""

    name = "history"

    def __init__(
        self,
        *,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int,
        decay: float = 0.95,
        depth: int = 1,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"history: decay must be in (0, 1], got {decay!r}")
        self.order = LayerOrder(moe_layers)
        self.num_experts, self.top_k, self.decay, self.depth = num_experts, top_k, decay, depth
        self._pop = {layer: np.zeros(num_experts) for layer in self.order.layers}

    def observe(self, layer: int, chosen: Sequence[int]) -> None:
        pop = self._pop.get(layer)
        if pop is None:
            return
        pop *= self.decay
        pop[np.asarray(chosen, dtype=np.int64)] += 1.0

    def predict(self, layer: int, chosen: Sequence[int], hidden: mx.array | None) -> Prediction:
        out: Prediction = []
        for target in self.order.after(layer, self.depth):
            ids = top_ids(self._pop[target], self.top_k)
            if ids:
                out.append((target, ids))
        return out

    def reset_sequence(self) -> None:
        pass  # popularity spans prompts on purpose: that is what makes it useful

    def params(self) -> dict[str, Any]:
        return {"decay": self.decay, "depth": self.depth}


class Transition:
    """Co-activation counts: layer l expert i -> next MoE layer expert j."""

    name = "transition"

    def __init__(self, *, moe_layers: Sequence[int], num_experts: int, top_k: int) -> None:
        self.order = LayerOrder(moe_layers)
        self.num_experts, self.top_k = num_experts, top_k
        # counts[j][i, e]: times layer prev(j) chose i and layer j chose e. Allocated on first
        # use; float32 E x E per layer (1 MiB at 512 experts).
        self._counts: dict[int, np.ndarray] = {}
        # A step's rows (tokens: a prefill chunk, a batch, a verify pass) come one by one
        # per layer: the layer before's rows and this one's so far, so that token i's row
        # here is paired with token i's there (the last row there was paired with the
        # first here, and every other pair was lost).
        self._prev: tuple[int, list[np.ndarray]] | None = None
        self._cur: tuple[int, list[np.ndarray]] | None = None

    def observe(self, layer: int, chosen: Sequence[int]) -> None:
        ids = np.asarray(chosen, dtype=np.int64)
        if self._cur is None or self._cur[0] != layer:
            self._prev, self._cur = self._cur, (layer, [])
        row = len(self._cur[1])
        self._cur[1].append(ids)
        prev = self._prev
        if prev is not None and prev[0] == self.order.previous(layer) and row < len(prev[1]):
            counts = self._counts.get(layer)
            if counts is None:
                counts = np.zeros((self.num_experts, self.num_experts), dtype=np.float32)
                self._counts[layer] = counts
            counts[np.ix_(prev[1][row], ids)] += 1.0

    def predict(self, layer: int, chosen: Sequence[int], hidden: mx.array | None) -> Prediction:
        targets = self.order.after(layer, 1)
        if not targets or targets[0] not in self._counts or len(chosen) == 0:
            return []
        rows = self._counts[targets[0]][np.asarray(chosen, dtype=np.int64)]
        ids = top_ids(rows.sum(axis=0), self.top_k)
        return [(targets[0], ids)] if ids else []

    def reset_sequence(self) -> None:
        self._prev = self._cur = None  # the last layer of one prompt does not lead into the next

    def params(self) -> dict[str, Any]:
        return {}


class Combined:
    """Reciprocal-rank fusion of several strategies' predictions, per target layer."""

    name = "combined"
    RRF_K = 60  # the usual RRF constant: damps the weight of any single list's top rank

    def __init__(self, strategies: Sequence[PrefetchStrategy], max_per_layer: int) -> None:
        if not strategies:
            raise ValueError("combined: needs at least one strategy")
        self.strategies = list(strategies)
        self.max_per_layer = max_per_layer
        self.needs_model = any(getattr(s, "needs_model", False) for s in self.strategies)

    def observe(self, layer: int, chosen: Sequence[int]) -> None:
        for s in self.strategies:
            s.observe(layer, chosen)

    def prepare(self, layer: int, hidden: mx.array) -> list[mx.array]:
        staged: list[mx.array] = []
        for s in self.strategies:
            prepare = getattr(s, "prepare", None)
            if prepare is not None:
                staged.extend(prepare(layer, hidden))
        return staged

    def predict(self, layer: int, chosen: Sequence[int], hidden: mx.array | None) -> Prediction:
        scores: dict[int, dict[int, float]] = {}
        for s in self.strategies:
            for target, ids in s.predict(layer, chosen, hidden):
                per = scores.setdefault(target, {})
                for rank, e in enumerate(ids):
                    per[e] = per.get(e, 0.0) + 1.0 / (self.RRF_K + rank + 1)
        out: Prediction = []
        for target in sorted(scores):
            ranked = sorted(scores[target].items(), key=lambda kv: (-kv[1], kv[0]))
            out.append((target, [e for e, _ in ranked[: self.max_per_layer]]))
        return out

    def reset_sequence(self) -> None:
        for s in self.strategies:
            s.reset_sequence()

    def params(self) -> dict[str, Any]:
        return {
            "max_per_layer": self.max_per_layer,
            "combine": [s.name for s in self.strategies],
        }
