"""The forward pass, stepped one MoE layer at a time so expert reads can interleave.

A `ForwardStep` runs on the MLX thread. It advances through the decoder until the next
MoE layer's routing is known, evaluates only the top-k ids (the one host sync per MoE
layer), and hands them out; the caller makes those experts resident in the pool and
calls `advance`, which computes the routed experts from pool slots and runs on to the
next routing. Everything else stays lazy, so MLX fuses it into that single sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from actors.forward import Presync, Routing
from pipeline.models.moe import moe_output, route, routed_experts
from pipeline.models.text_parts import TextParts, moe_layers, text_parts
from qpack.spec import ExpertFormat


class StreamedModel:
    """The resident dense core plus a view of the pool's slot arrays."""

    def __init__(
        self,
        model: nn.Module,
        fmt: ExpertFormat,
        slot_arrays: dict[str, mx.array],
        activation_dtype: mx.Dtype | None = None,
        views: Callable[[int], tuple[dict[str, mx.array], ExpertFormat]] | None = None,
    ):
        self.model = model
        self.activation_dtype = activation_dtype  # None: whatever the embedding yields
        self.parts: TextParts = text_parts(model)
        self.fmt = fmt
        self.slot_arrays = slot_arrays  # owned by the pool, updated in place on install
        self.views = views  # layer -> (its slot arrays, its format) when layers differ
        self.moe_layers = moe_layers(self.parts)
        self.num_layers = len(self.parts.layers)
        self.num_experts = self.parts.layers[self.moe_layers[0]].mlp.num_experts
        self.top_k = self.parts.layers[self.moe_layers[0]].mlp.top_k

    def step(self, tokens: list[int], cache: list[Any]) -> ForwardStep:
        return ForwardStep(self, tokens, cache)

    def make_cache(self) -> list[Any]:
        return self.parts.make_cache()

    def router_logits(self, layer: int, hidden: mx.array) -> mx.array:
        """Layer `layer`'s router applied to a residual-stream state (for next-gate prefetch)."""
        block = self.parts.layers[layer]
        return block.mlp.gate(block.post_attention_layernorm(hidden))


def activation_dtype(setting: str) -> mx.Dtype | None:
    """The dtype a `compute.dtype` setting asks for on this machine's default device."""
    if setting == "model":
        return None
    if setting == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, setting)


class ForwardStep:
    """One forward call over `tokens` (a prefill chunk or one decode token)."""

    def __init__(self, model: StreamedModel, tokens: list[int], cache: list[Any]):
        self.m = model
        self.cache = cache
        h = model.parts.embed_tokens(mx.array([tokens]))
        if model.activation_dtype is not None:
            h = h.astype(model.activation_dtype)
        first_fa = next((i for i, b in enumerate(model.parts.layers) if not b.is_linear), None)
        first_ssm = next((i for i, b in enumerate(model.parts.layers) if b.is_linear), None)
        self.fa_mask = None if first_fa is None else create_attention_mask(h, cache[first_fa])
        self.ssm_mask = None if first_ssm is None else create_ssm_mask(h, cache[first_ssm])
        self.h = h
        self.layer = 0
        self._pending: tuple[mx.array, mx.array, mx.array, mx.array] | None = None

    def _mask(self, block: nn.Module) -> Any:
        return self.ssm_mask if block.is_linear else self.fa_mask

    def run_to_routing(self, presync: Presync | None = None) -> Routing | None:
        """Advance to the next MoE layer's routing; None once every layer has run.

        `presync(layer, hidden)` may return more lazy arrays (a prefetch prediction) to
        evaluate in the same sync as the routing.
        """
        moe = self.m.moe_layers
        while self.layer < self.m.num_layers:
            block = self.m.parts.layers[self.layer]
            cache = self.cache[self.layer]
            if self.layer not in moe:
                self.h = block(self.h, mask=self._mask(block), cache=cache)
                self.layer += 1
                continue
            mixer = block.linear_attn if block.is_linear else block.self_attn
            h_mid = self.h + mixer(block.input_layernorm(self.h), self._mask(block), cache)
            x = block.post_attention_layernorm(h_mid)
            inds, scores = route(block.mlp, x)
            hidden = h_mid[0]
            extra = presync(self.layer, hidden) if presync is not None else []
            mx.eval(inds, *extra)
            self._pending = (h_mid, x, inds, scores)
            ids = np.asarray(inds).reshape(-1, inds.shape[-1])
            return Routing(self.layer, ids, hidden)
        return None

    def advance(self, slot_of: np.ndarray, presync: Presync | None = None) -> Routing | None:
        """Finish the pending MoE layer; `slot_of[e]` is expert e's pool slot (needed ones only)."""
        assert self._pending is not None, "advance() without a pending routing"
        h_mid, x, inds, scores = self._pending
        self._pending = None
        slots = mx.array(slot_of.astype(np.int32))[inds]
        block = self.m.parts.layers[self.layer]
        arrays, fmt = self.m.views(self.layer) if self.m.views else (self.m.slot_arrays, self.m.fmt)
        routed = routed_experts(arrays, fmt, x, slots)
        self.h = h_mid + moe_output(block.mlp, x, routed, scores)
        self.layer += 1
        return self.run_to_routing(presync)

    def logits(self, all_positions: bool = False) -> mx.array:
        """Final logits, [vocab] for the last position (or [tokens, vocab]); evaluated."""
        h = self.h if all_positions else self.h[:, -1:, :]
        out = self.m.parts.head(self.m.parts.norm(h))[0]
        states = [a for c in self.cache for a in c.state if a is not None]
        mx.eval(out, states)
        return out if all_positions else out[0]
