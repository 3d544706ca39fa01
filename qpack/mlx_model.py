"""mlx-lm's model classes for a config: the families a `.qpack` can hold.

mlx-lm's own lookup (`mlx_lm.utils._get_classes`) is private; ours is the public part of
it (one module per architecture under `mlx_lm.models`, each with `Model` and
`ModelArgs`), limited to the model types of a registered family (qpack.families).
"""

from __future__ import annotations

import importlib
from typing import Any

from qpack.families import family


def model_classes(config: dict[str, Any]) -> tuple[type[Any], type[Any]]:
    """(Model, ModelArgs) of mlx-lm for `config["model_type"]` (ValueError, one line, if unsupported)."""
    module = importlib.import_module(f"mlx_lm.models.{family(config.get('model_type')).name}")
    return module.Model, module.ModelArgs
