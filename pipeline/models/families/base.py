"""What a model family tells the streamed forward pass: layer kinds, caches, its MoE block.

A family's forward side (pipeline/models/families/<name>.py, named as its checkpoint side
in qpack/families) defines one `ForwardFamily` subclass and exposes an instance as
`FAMILY`. The defaults are the plainest decoder: full attention in every layer (a KV
cache each), mlx-lm's softmax top-k router (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`), no
shared expert. Every method works on mlx-lm's own modules and repeats their arithmetic in
their order, so the streamed forward stays bit-identical to mlx-lm's resident model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu


class ForwardFamily:
    # Its attention reads a quantized KV cache through mlx-lm's SDPA (compute.kv_bits:
    # pipeline/models/kv_quant.py); not with attention sinks or latent attention.
    quantized_kv = True

    def text_model(self, model: nn.Module) -> nn.Module:
        """The text model inside mlx-lm's Model (a multimodal one nests it as language_model)."""
        return model.language_model if "language_model" in model else model

    def is_linear(self, block: nn.Module) -> bool:
        """Whether a decoder layer is recurrent (Gated DeltaNet: conv + state cache, SSM mask)."""
        return False

    def new_cache(self, block: nn.Module) -> Any:
        from mlx_lm.models.cache import KVCache

        return KVCache()

    def attention_mask(self, h: mx.array, cache: Any) -> Any:
        """The mask the attention layers take for `h` over `cache`, as the family's mlx-lm
        model makes it ("causal", an array, or None for one token)."""
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(h, cache)

    def is_sliding(self, block: nn.Module) -> bool:
        """Whether an attention layer attends over a sliding window (gpt-oss's
        sliding_attention layers: a RotatingKVCache and `sliding_mask`)."""
        return False

    def sliding_mask(self, h: mx.array, cache: Any) -> Any:
        """The mask of the sliding-window layers for `h` over `cache` (one such layer's)."""
        raise NotImplementedError

    def activation(self, gate: mx.array, up: mx.array) -> mx.array:
        """The routed experts' GLU, as the family's SwitchGLU applies it."""
        return swiglu(gate, up)

    def mixer(self, block: nn.Module) -> nn.Module:
        """The layer's token mixer (attention), called as mixer(x, mask, cache)."""
        return block.self_attn

    def is_moe(self, block: nn.Module) -> bool:
        """Whether a decoder layer routes to experts (else its MLP is dense)."""
        return "gate" in block.mlp

    def experts(self, mlp: nn.Module) -> tuple[int, int]:
        """(routed experts, experts per token) of an MoE block."""
        return int(mlp.num_experts), int(mlp.top_k)

    def route(self, mlp: nn.Module, x: mx.array, forced: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Top-k expert ids and their weights, exactly as the family's mlx-lm MoE block.

        `forced` (benchmark-only calibrated routing, pipeline/models/routing_override.py)
        replaces the ids; their weights are still the router's at those ids."""
        gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
        k = mlp.top_k
        inds = argtop(gates, k) if forced is None else keep_graph(forced, gates)
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if mlp.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores

    def moe_output(self, mlp: nn.Module, x: mx.array, routed: mx.array, scores: mx.array) -> mx.array:
        """The MoE block's output from the routed experts' [..., k, H] outputs (and the
        family's shared expert, if any)."""
        return (routed * scores[..., None]).sum(axis=-2).astype(routed.dtype)

    def router_scores(self, block: nn.Module, hidden: mx.array) -> mx.array:
        """Scores whose ranking is the router's choice, for a residual-stream state: what
        next-gate prefetch ranks (a softmax router's logits rank as its probabilities)."""
        return block.mlp.gate(block.post_attention_layernorm(hidden))

    def state_bytes(self, block: nn.Module, args: Any, positions: int, itemsize: int) -> int:
        """Bytes of one sequence's cache in this layer after `positions` (256-rounded) tokens;
        `args`: the text model's ModelArgs (shapes are read from it, not from weights a
        pipeline rank may not hold)."""
        return 2 * positions * args.num_key_value_heads * args.head_dim * itemsize


def argtop(gates: mx.array, k: int) -> mx.array:
    """mlx-lm's top-k ids: argpartition of the gates, the last k."""
    return mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]


def keep_graph(forced: mx.array, before: mx.array) -> mx.array:
    # Evaluating the ids must still evaluate everything before this router (the per-layer
    # sync is what finishes the layers that read pool slots before the pool overwrites
    # them): constant ids would leave that graph lazy.
    return mx.depends(forced, before)
