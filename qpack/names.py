"""Which source tensors belong to the text model, under mlx-lm's names.

Shared by the source reader (which renames what it packs) and the pre-download checks
(which skip shards that hold none of it), so both agree on what "text tensor" means. The
renames are the family's (qpack.families); dropping MTP heads is everyone's rule.
"""

from __future__ import annotations

from typing import Any

from qpack.families import family


def target_name(model_type: str, name: str, text: dict[str, Any] | None = None) -> str | None:
    """mlx-lm's name for a source tensor (its model's `sanitize`); None drops the tensor.

    `text`: the text model's config (a family may need it: GLM's MTP layer is the one
    numbered num_hidden_layers)."""
    if "mtp." in name:
        return None
    return family(model_type).target_name(name, text or {})


def is_text_tensor(model_type: str, name: str, text: dict[str, Any] | None = None) -> bool:
    """Whether a source tensor is part of the text model (the rest is never read)."""
    return target_name(model_type, name, text) is not None
