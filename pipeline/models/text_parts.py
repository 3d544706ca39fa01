"""Where each supported architecture keeps the pieces the streamed forward pass needs.

Qwen3-Next keeps its decoder at `model.model`; Qwen3.5/3.6 MoE nests the same decoder
under `model.language_model`. Both reuse the same decoder-layer structure (mlx-lm's
qwen3_5 imports qwen3_next's attention, MLP and sparse-MoE blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

SUPPORTED = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class TextParts:
    embed_tokens: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Module | None  # None: tied to embed_tokens
    args: Any

    def head(self, h: mx.array) -> mx.array:
        if self.lm_head is None:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import ArraysCache, KVCache

        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]


def text_parts(model: nn.Module) -> TextParts:
    text = model.language_model if "language_model" in model else model
    args = text.args
    return TextParts(
        embed_tokens=text.model.embed_tokens,
        layers=list(text.layers),
        norm=text.model.norm,
        lm_head=None if args.tie_word_embeddings else text.lm_head,
        args=args,
    )


def moe_layers(parts: TextParts) -> list[int]:
    return [i for i, layer in enumerate(parts.layers) if "gate" in layer.mlp]
