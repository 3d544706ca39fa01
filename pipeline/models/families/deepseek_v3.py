"""DeepSeek-V3 / Kimi-K2's forward side: mlx-lm's deepseek_v3 MoE block is GLM-4.5's (its
MoEGate: sigmoid, correction bias for the choice, grouped top-k, renormalized and scaled;
shared experts added unweighted; dense first layers). What differs is the attention:
multi-head latent attention takes its causal mask as an array (it masks the rotary scores
itself) and caches one latent and one rotary key per position, shared by every head."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pipeline.models.families.glm4_moe import Glm4Moe


class DeepseekV3(Glm4Moe):
    quantized_kv = False  # latent attention caches a compressed KV, not keys and values

    def attention_mask(self, h: mx.array, cache: Any) -> Any:
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(h, cache, return_array=True)  # DeepseekV3Model's own call

    def state_bytes(self, block: nn.Module, args: Any, positions: int, itemsize: int) -> int:
        """The latent (kv_lora_rank) and the rotary key (qk_rope_head_dim) per position."""
        return positions * (args.kv_lora_rank + args.qk_rope_head_dim) * itemsize


FAMILY = DeepseekV3()
