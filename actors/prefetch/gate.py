"""Gate-based prefetch: apply later layers' routers to the current hidden state.

The residual stream changes slowly from layer to layer, so layer l+1's router applied to
the hidden state after layer l's attention predicts l+1's routing well; `depth` > 1 does
the same for l+1..l+d ("lookahead"). The model supplies `routers(layer, hidden)`, which
applies that layer's post-attention norm and router gate and returns logits.

All target layers are evaluated as one MLX graph and read back with a single `.tolist()`:
the host sync is the expensive part, not the tiny matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from actors.mx_typed import int_rows
from actors.prefetch.strategies import LayerOrder, Prediction

RouterFn = Callable[[int, mx.array], mx.array]


class NextGate:
    needs_model = True  # predicts from the routers and the hidden state, on the MLX thread
    def __init__(
        self,
        routers: RouterFn,
        *,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int,
        depth: int = 1,
        extra: int = 0,
        cap: int | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"next-gate: depth must be >= 1, got {depth!r}")
        if top_k < 1 or extra < 0 or (cap is not None and cap < 1):
            raise ValueError(f"next-gate: bad top_k={top_k!r} / extra={extra!r} / cap={cap!r}")
        self.name = "next-gate" if depth == 1 else "lookahead"
        self.routers = routers
        self.order = LayerOrder(moe_layers)
        self.num_experts, self.top_k, self.depth, self.extra = num_experts, top_k, depth, extra
        # prefetch.max_per_layer: a layer's predictions cut to the best `cap` (a verify
        # pass's union ranks the experts more of its tokens pick first).
        self.cap = cap
        self._staged: tuple[int, mx.array, mx.array, bool] | None = None

    def params(self) -> dict[str, Any]:
        return {"depth": self.depth, "extra": self.extra, "max_per_layer": self.cap}

    def observe(self, layer: int, chosen: Sequence[int]) -> None:
        pass  # stateless: the routers carry the knowledge

    def reset_sequence(self) -> None:
        pass

    def _logits(self, targets: list[int], hidden: mx.array) -> mx.array:
        # Routers always see [tokens, H]: a 1-D input to the quantized gate raised
        # "SmallVector out of range" on MLX 0.32.4's CUDA backend.
        one = hidden.ndim == 1 or hidden.shape[0] == 1
        logits = mx.stack([self.routers(t, hidden.reshape(-1, hidden.shape[-1])) for t in targets])
        return (logits[:, 0] if one else logits).astype(mx.float32)

    def prepare(self, layer: int, hidden: mx.array) -> list[mx.array]:
        """Build (lazily) what `predict(layer, ...)` will read: one decode token's ranking,
        or several tokens' union (a verify pass).

        The caller evaluates the returned arrays in the same sync as layer `layer`'s
        routing, so the prediction costs no host round trip of its own.
        """
        targets = self.order.after(layer, self.depth)
        if not targets:
            self._staged = None
            return []
        ranked, union = self._rank(targets, self._logits(targets, hidden))
        self._staged = (layer, hidden, ranked, union)
        return [ranked]

    def ranking(self, layer: int, hidden: mx.array) -> mx.array | None:
        """One decode token's ranking for the layers after `layer`, lazily and without
        staging it (a token queued whole publishes it from the GPU: actors/device_wait.py);
        `predict_ranked` reads it back. None where no layer follows."""
        targets = self.order.after(layer, self.depth)
        return self._ranked(self._logits(targets, hidden)) if targets else None

    def predict_ranked(self, layer: int, ranked: np.ndarray) -> Prediction:
        """`predict` from `ranking`'s values, read back (flattened: [targets * n])."""
        targets = self.order.after(layer, self.depth)
        if not targets or ranked.size == 0:
            return []
        rows = ranked.reshape(len(targets), -1).tolist()
        return [(t, ids[: self.cap]) for t, ids in zip(targets, rows, strict=True) if ids]

    def predict(self, layer: int, chosen: Sequence[int], hidden: mx.array | None) -> Prediction:
        targets = self.order.after(layer, self.depth)
        if hidden is None or not targets:
            return []
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == layer and staged[1] is hidden:
            ranked, union = staged[2], staged[3]
        else:
            ranked, union = self._rank(targets, self._logits(targets, hidden))
        rows = int_rows(ranked)
        if union:  # each row leads with how many experts some token picks
            rows = [row[1 : 1 + min(self.num_experts, row[0] + self.extra)] for row in rows]
        return [(t, ids[: self.cap]) for t, ids in zip(targets, rows, strict=True) if ids]

    def _rank(self, targets: list[int], logits: mx.array) -> tuple[mx.array, bool]:
        """(lazy ranking, whether it is several tokens' union) for `targets`' logits."""
        if logits.ndim == 2:
            return self._ranked(logits), False
        if logits.ndim == 3:
            return self._union(logits), True
        raise ValueError(
            f"next-gate: router logits for layer {targets[0]} have shape "
            f"{tuple(logits.shape[1:])}; expected [experts] or [tokens, experts]"
        )

    def _ranked(self, logits: mx.array) -> mx.array:
        # One token: top (k + extra) by logit. argpartition then sort only those n.
        # A full argsort (E is a few hundred): argpartition + take_along_axis here raised
        # "SmallVector out of range" on MLX 0.32.4's CUDA backend.
        n = min(self.num_experts, self.top_k + self.extra)
        return mx.argsort(-logits, axis=-1)[:, :n]

    def _union(self, logits: mx.array) -> mx.array:
        # Several tokens (a verify pass, a prefill chunk): the demand will be the union of
        # their top-k, so rank experts by how many tokens pick them, mean probability
        # breaking ties; every expert some token picks (+ extra) is kept. [d, 1 + E]: each
        # row's count of picked experts, then the ranking.
        k = min(self.num_experts, self.top_k)
        top = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k - 1 : k]
        threshold = mx.take_along_axis(logits, top, axis=-1)
        counts = (logits >= threshold).astype(mx.float32).sum(axis=1)  # [d, E]
        score = counts + mx.softmax(logits, axis=-1).mean(axis=1)
        order = mx.argsort(-score, axis=-1)
        picked = (counts > 0).sum(axis=-1, keepdims=True).astype(order.dtype)
        return mx.concatenate([picked, order], axis=-1)
