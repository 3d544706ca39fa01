"""mlx-lm's model classes for a config: the two families we pack and stream.

mlx-lm's own lookup (`mlx_lm.utils._get_classes`) is private; ours is the public part of
it (one module per architecture under `mlx_lm.models`, each with `Model` and
`ModelArgs`), limited to the model types a `.qpack` can hold.
"""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe")


def model_classes(config: dict[str, Any]) -> tuple[type[Any], type[Any]]:
    """(Model, ModelArgs) of mlx-lm for `config["model_type"]`."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model, module.ModelArgs
