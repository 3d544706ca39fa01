"""Qwen3.5/3.6 MoE's forward side: Qwen3-Next's decoder (mlx-lm's qwen3_5 reuses its
blocks) under `language_model`, which the base class already finds."""

from __future__ import annotations

from pipeline.models.families.qwen3_next import QwenHybrid

FAMILY = QwenHybrid()
