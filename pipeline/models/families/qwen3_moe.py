"""Qwen3 MoE's forward side: full attention everywhere, mlx-lm's Qwen3MoeSparseMoeBlock
(softmax top-k, norm_topk_prob, no shared expert): the base class as it is."""

from __future__ import annotations

from pipeline.models.families.base import ForwardFamily

FAMILY = ForwardFamily()
