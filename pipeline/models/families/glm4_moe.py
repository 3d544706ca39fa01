"""GLM-4.5's forward side: mlx-lm's glm4_moe MoE block. The router is its MoEGate (sigmoid
scores, e_score_correction_bias added for the choice only, grouped top-k, renormalized
and scaled by routed_scaling_factor: `group_expert_select`), the shared experts are added
unweighted; the first layers are dense (no `gate` in their MLP)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from pipeline.models.families.base import ForwardFamily, keep_graph


class Glm4Moe(ForwardFamily):
    def experts(self, mlp: nn.Module) -> tuple[int, int]:
        return int(mlp.gate.n_routed_experts), int(mlp.num_experts_per_tok)

    def route(self, mlp: nn.Module, x: mx.array, forced: mx.array | None = None) -> tuple[mx.array, mx.array]:
        gate = mlp.gate
        if forced is None:
            return gate(x)  # mlx-lm's own compiled selection: the same bits
        scores = mx.sigmoid((x @ gate.weight.T).astype(mx.float32))
        inds = keep_graph(forced, scores)
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if gate.top_k > 1 and gate.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights * gate.routed_scaling_factor

    def moe_output(self, mlp: nn.Module, x: mx.array, routed: mx.array, scores: mx.array) -> mx.array:
        y = (routed * scores[..., None]).sum(axis=-2).astype(routed.dtype)
        return y + mlp.shared_experts(x) if "shared_experts" in mlp else y

    def router_scores(self, block: nn.Module, hidden: mx.array) -> mx.array:
        """The choice scores (sigmoid + correction bias); group masking is left out, a
        prediction needs the ranking only."""
        gate = block.mlp.gate
        x = block.post_attention_layernorm(hidden)
        return mx.sigmoid((x @ gate.weight.T).astype(mx.float32)) + gate.e_score_correction_bias


FAMILY = Glm4Moe()
