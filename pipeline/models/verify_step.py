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
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_ssm_mask

from pipeline.models.streamed import ForwardStep, StreamedModel, _restore, _snapshot


def can_verify(model: StreamedModel) -> bool:
    """Every DeltaNet layer is a MoE layer (the real models' layout): its input is then
    recorded on the way through `_mix_and_route`, the one place the pass can see it.
    Every other layer's cache is a plain KV cache, cut back by its offset (a sliding
    window's rotating buffer cannot be)."""
    from mlx_lm.models.cache import KVCache

    linear = model.family.is_linear
    return all(i in model.moe_layers if linear(model.parts.layers[i])
               else type(model.family.new_cache(model.parts.layers[i])) is KVCache
               for i in model.layers)


class VerifyStep(ForwardStep):
    """A `ForwardStep` over one sequence's T tokens whose logits are all T positions'."""

    def __init__(self, model: StreamedModel, tokens: list[int], cache: list[Any]) -> None:
        self._before = [_snapshot(c) for c in cache]
        self._linear_in: dict[int, mx.array] = {}
        self.positions = len(tokens)
        self._kept = self.positions  # the positions the caches hold now
        super().__init__(model, tokens, cache)

    def _mix_and_route(self, block: nn.Module) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        # A run-ahead that missed redoes layers from there: the last call's input stands.
        if self.m.family.is_linear(block):
            self._linear_in[self.layer] = self.h
        return super()._mix_and_route(block)

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
            if not self.m.family.is_linear(block):
                cache.offset = before["offset"] + n
                continue
            if n == self._kept == self.positions:
                continue  # still the state after the whole pass
            _restore(cache, before)
            h = self._linear_in[i][:, :n]
            block.linear_attn(block.input_layernorm(h), create_ssm_mask(h, cache), cache)
        self._kept = n
