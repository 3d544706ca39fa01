"""Import mlx-lm's model modules without its package `__init__`.

`mlx_lm/__init__.py` imports its convert and generate entry points, which import
transformers: ~210 MiB of resident memory (measured: 50 MiB after MLX, numpy, trio;
266 MiB after `import mlx_lm.models.base`) for code the engine never calls. Its tokenizer
is replaced by `pipeline.tokenizer` (one Rust object). Registering the package module
unexecuted lets `import mlx_lm.models.x` run only the submodules it names; a later
`import mlx_lm.utils` (tests, reference benchmarks) still works, at its own cost.
"""

from __future__ import annotations

import importlib.util
import sys


def register_without_init() -> None:
    """Put an unexecuted `mlx_lm` package in sys.modules, unless one is there already."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None:  # not installed: the import that needs it says so
        return
    sys.modules["mlx_lm"] = importlib.util.module_from_spec(spec)
