"""Where a model keeps the pieces the streamed forward pass needs, and its family.

mlx-lm's models keep the decoder at `model.model` (Qwen3-Next, Qwen3-MoE, GLM) or nest
it under `model.language_model` (Qwen3.5/3.6 MoE); the family's forward side
(pipeline/models/families) says which, and what each layer's cache is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pipeline.models.families import ForwardFamily, of_model


@dataclass(frozen=True)
class TextParts:
    embed_tokens: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Module | None  # None: tied to embed_tokens
    args: Any
    family: ForwardFamily

    def head(self, h: mx.array) -> mx.array:
        if self.lm_head is None:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[Any]:
        return [self.family.new_cache(layer) for layer in self.layers]


def text_parts(model: nn.Module) -> TextParts:
    family = of_model(model)
    text = family.text_model(model)
    args = text.args
    return TextParts(
        embed_tokens=text.model.embed_tokens,
        layers=list(text.layers),
        norm=text.model.norm,
        lm_head=None if getattr(args, "tie_word_embeddings", False) else text.lm_head,
        args=args,
        family=family,
    )


def moe_layers(parts: TextParts) -> list[int]:
    return [i for i, layer in enumerate(parts.layers) if parts.family.is_moe(layer)]
