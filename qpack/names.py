"""Which source tensors belong to the text model, under mlx-lm's names.

Shared by the source reader (which renames what it packs) and the pre-download checks
(which skip shards that hold none of it), so both agree on what "text tensor" means.
"""

from __future__ import annotations

MODEL_TYPE_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}


def target_name(model_type: str, name: str) -> str | None:
    """mlx-lm's key renames (qwen3_5_moe.Model.sanitize); None drops the tensor.

    Only the text model's tensors are kept: besides MTP heads and the hub's
    `model.visual.*`, that drops community MLX layouts' `language_model.vision_tower.*`
    (and any other tower), which mlx-lm's text model would refuse at load."""
    if "mtp." in name:
        return None
    if model_type == "qwen3_next":
        return name if name.startswith(("model.", "lm_head.")) else None
    if name.startswith(("vision_tower", "model.visual")):
        return None
    if name.startswith("model.language_model"):
        target = name.replace("model.language_model", "language_model.model", 1)
    elif name.startswith("language_model."):
        target = name
    else:
        target = "language_model." + name
    return target if target.startswith(("language_model.model.", "language_model.lm_head.")) else None


def is_text_tensor(model_type: str, name: str) -> bool:
    """Whether a source tensor is part of the text model (the rest is never read)."""
    return target_name(model_type, name) is not None
