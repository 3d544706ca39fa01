"""A verify pass: one forward over the last token and a draft, every position's logits,
and the caches brought back to any accepted prefix exactly.

Speculative decoding feeds [last token, d1 .. dk] in one pass (a prefill chunk with
the cache) and keeps the longest prefix the model agrees with. Attention's KV cache is
cut back by its offset (positions past it are overwritten by the next write). A Gated
DeltaNet state cannot be rewound, so the pass keeps what restoring it needs: the caches
as they were before the pass (a shallow snapshot, as the run-ahead takes) and the
residual stream entering each DeltaNet layer. `keep(n)` puts each DeltaNet layer back
to the snapshot and runs only its mixer over the first n positions' inputs: causal
attention and the recurrence make those inputs the same whether or not later positions
exist, and a mixer over n tokens computes what n one-token steps compute (bit for bit
on MLX's CPU backend: tests/test_speculative.py), so the state is the one plain decode
would have. No MoE, no attention layer and no expert read is redone.

A sliding-window layer's ring (mlx-lm's RotatingKVCache: gpt-oss) can be neither cut
back nor fed several tokens the way plain decode feeds it one: a multi-token update
re-lays the ring out in time order, `window - 1 + T` long, which a later one-token step
attends over in another order than plain decode's ring (softmax sums in another order:
other bits once it has wrapped). So the pass runs such a layer's attention one position
at a time, each with the mask and the in-place ring write plain decode's step makes
(attention only: its MoE half still runs once over all T positions), and holds the ring
as it stands after each position (a reference is a snapshot: MLX arrays are values, and
`snapshot_cache` takes a ring's buffers as distinct objects, so later writes leave them be).
`keep(n)` puts that layer's cache back to the ring after position n: plain decode's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_ssm_mask

from pipeline.models.run_ahead import restore_cache, snapshot_cache
from pipeline.models.streamed import ForwardStep, StreamedModel


def can_verify(model: StreamedModel) -> bool:
    """Every DeltaNet or sliding-window layer is a MoE layer (the real models' layout): the
    pass then sees it in `_mix_and_route`, the one place it records or steps a mixer.
    A DeltaNet layer's state is restored by re-running its mixer, a sliding layer's ring
    (exactly mlx-lm's RotatingKVCache, whose write position `_idx` the ring steps) by its
    state after each position; every other layer's cache is a plain KV cache, cut back by
    its offset."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    family = model.family

    def fits(i: int) -> bool:
        block = model.parts.layers[i]
        if family.is_linear(block):
            return i in model.moe_layers
        kind = type(family.new_cache(block))
        if family.is_sliding(block):
            return kind is RotatingKVCache and i in model.moe_layers
        return kind is KVCache

    return all(fits(i) for i in model.layers)


class VerifyStep(ForwardStep):
    """A `ForwardStep` over one sequence's T tokens whose logits are all T positions'."""

    def __init__(self, model: StreamedModel, tokens: list[int], cache: list[Any]) -> None:
        self._before = [snapshot_cache(c) for c in cache]
        self._linear_in: dict[int, mx.array] = {}
        self._rings: dict[int, list[dict[str, Any]]] = {}  # sliding layer -> ring after each position
        self.positions = len(tokens)
        self._kept = self.positions  # the positions the caches hold now
        super().__init__(model, tokens, cache)

    def _mix_and_route(self, block: nn.Module) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        # A run-ahead that missed redoes layers from there: the last call's input stands.
        if self.m.family.is_linear(block):
            self._linear_in[self.layer] = self.h
        return super()._mix_and_route(block)

    def _mixed(self, block: nn.Module) -> mx.array:
        if not self.m.family.is_sliding(block):
            return super()._mixed(block)
        # Plain decode's attention step per position: the same ring writes and masks, so
        # the same keys in the same slots and the same sums (see the module docstring).
        mixer, cache = self.m.family.mixer(block), self.cache[self.layer]
        x = block.input_layernorm(self.h)
        outs, rings = [], []
        for j in range(x.shape[1]):
            xj = x[:, j : j + 1]
            outs.append(mixer(xj, self.m.family.sliding_mask(xj, cache), cache))
            rings.append(snapshot_cache(cache))
        self._rings[self.layer] = rings  # a resumed layer steps again from the snapshot
        return mx.concatenate(outs, axis=1)

    def _last_logits(self) -> mx.array:
        """Every position's logits, [T, vocab] (what the run-ahead evaluates, too)."""
        return self.m.parts.head(self.m.parts.norm(self.h))[0]

    def logits(self, all_positions: bool = True) -> mx.array:
        return super().logits(all_positions=True)

    def keep(self, n: int) -> None:
        """The caches as after the first `n` of this pass's positions (1 <= n <= T), lazily.

        Callable more than once (each starts from the snapshot), so a caller may first
        keep the accepted prefix, then fewer positions when fewer of its tokens are used.
        """
        if not 1 <= n <= self.positions:
            raise ValueError(f"keep({n}) outside 1..{self.positions}")
        for i in self.m.layers:
            block = self.m.parts.layers[i]
            cache, before = self.cache[i], self._before[i]
            if i in self._rings:
                restore_cache(cache, self._rings[i][n - 1])
                continue
            if not self.m.family.is_linear(block):
                cache.offset = before["offset"] + n
                continue
            if n == self._kept == self.positions:
                continue  # still the state after the whole pass
            restore_cache(cache, before)
            h = self._linear_in[i][:, :n]
            block.linear_attn(block.input_layernorm(h), create_ssm_mask(h, cache), cache)
        self._kept = n
