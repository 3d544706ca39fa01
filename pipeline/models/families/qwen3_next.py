"""Qwen3-Next's forward side: Gated DeltaNet layers beside gated attention, and a shared
expert behind a sigmoid gate (mlx-lm's Qwen3NextSparseMoeBlock). Qwen3.5/3.6 reuse it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pipeline.models.families.base import ForwardFamily


class QwenHybrid(ForwardFamily):
    def is_linear(self, block: nn.Module) -> bool:
        return bool(block.is_linear)

    def new_cache(self, block: nn.Module) -> Any:
        from mlx_lm.models.cache import ArraysCache, KVCache

        return ArraysCache(size=2) if block.is_linear else KVCache()

    def mixer(self, block: nn.Module) -> nn.Module:
        return block.linear_attn if block.is_linear else block.self_attn

    def moe_output(self, mlp: nn.Module, x: mx.array, routed: mx.array, scores: mx.array) -> mx.array:
        y = (routed * scores[..., None]).sum(axis=-2)
        shared = mlp.shared_expert(x)
        return y + mx.sigmoid(mlp.shared_expert_gate(x)) * shared

    def state_bytes(self, block: nn.Module, args: Any, positions: int, itemsize: int) -> int:
        """Keys and values per attention layer; the conv and recurrent state per Gated
        DeltaNet layer (fixed size, float32 state)."""
        if not block.is_linear:
            at = block.self_attn
            return 2 * positions * at.num_key_value_heads * at.head_dim * itemsize
        la = block.linear_attn
        return ((la.conv_kernel_size - 1) * la.conv_dim * itemsize
                + la.num_v_heads * la.head_v_dim * la.head_k_dim * 4)


FAMILY = QwenHybrid()
