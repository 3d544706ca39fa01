"""gpt-oss's forward side: mlx-lm's gpt_oss MLPBlock and its alternating attention.

Every layer routes (`mlp.router`, a Linear with bias: top-k of the logits, then a softmax
over those k, `precise`); the experts' GLU is `swiglu_oai` (gate clamped above at 7.0, up
clipped to +-7.0, sigmoid gain 1.702, (up + 1) * glu) and each projection adds its expert's
bias (the pool holds it beside the weights). Layers alternate sliding-window and full
attention as the model's `layer_types` say: a sliding layer has mlx-lm's RotatingKVCache
(max_size = sliding_window) and the mask made over it with that window, a full layer a
KVCache and the plain causal mask, exactly as GptOssMoeModel builds them (one mask per kind,
from the first layer of that kind). The layer type is not on mlx-lm's blocks, so
`text_model` marks each block with it (a plain attribute, no parameter)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu_oai

from pipeline.models.families.base import ForwardFamily, keep_graph


class GptOss(ForwardFamily):
    quantized_kv = False  # attention sinks: mlx-lm's quantized SDPA has none

    def text_model(self, model: nn.Module) -> nn.Module:
        inner = model.model
        for block, kind in zip(inner.layers, inner.layer_types, strict=True):
            block.sliding_window = inner.window_size if kind == "sliding_attention" else 0
        return model

    def is_sliding(self, block: nn.Module) -> bool:
        return bool(getattr(block, "sliding_window", 0))

    def new_cache(self, block: nn.Module) -> Any:
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        return RotatingKVCache(max_size=block.sliding_window) if self.is_sliding(block) else KVCache()

    def sliding_mask(self, h: mx.array, cache: Any) -> Any:
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(h, cache, window_size=cache.max_size)

    def is_moe(self, block: nn.Module) -> bool:
        return "router" in block.mlp

    def experts(self, mlp: nn.Module) -> tuple[int, int]:
        return int(mlp.num_local_experts), int(mlp.num_experts_per_tok)

    def route(self, mlp: nn.Module, x: mx.array, forced: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """mlx-lm's MLPBlock: `mlx_topk` (argpartition, the last k, their logits), softmax."""
        g = mlp.router(x)
        k = mlp.num_experts_per_tok
        if forced is None:
            inds = mx.stop_gradient(mx.argpartition(g, kth=-k, axis=-1)[..., -k:])
        else:
            inds = keep_graph(forced, g)
        top = mx.take_along_axis(g, inds, axis=-1)
        return inds, mx.softmax(top, axis=-1, precise=True)

    def moe_output(self, mlp: nn.Module, x: mx.array, routed: mx.array, scores: mx.array) -> mx.array:
        return (routed * mx.expand_dims(scores, axis=-1)).sum(axis=-2)  # no cast: mlx-lm has none

    def activation(self, gate: mx.array, up: mx.array) -> mx.array:
        return swiglu_oai(gate, up)  # SwigluOAI's defaults, as mlx-lm builds it (alpha 1.702, limit 7.0)

    def router_scores(self, block: nn.Module, hidden: mx.array) -> mx.array:
        """The router's logits: their top-k is its choice."""
        return block.mlp.router(block.post_attention_layernorm(hidden))

    def state_bytes(self, block: nn.Module, args: Any, positions: int, itemsize: int) -> int:
        """A sliding layer keeps at most its window (RotatingKVCache; a prefill chunk may add
        up to one chunk more for the step), a full layer every position."""
        window = getattr(block, "sliding_window", 0)
        kept = min(positions, window) if window else positions
        return 2 * kept * args.num_key_value_heads * args.head_dim * itemsize


FAMILY = GptOss()
