"""The `.qpack` container: routed experts on disk, one aligned read per expert.

    from qpack import Container, pack, verify, QpackError

`spec` (the format), `reader` (Container, checksums), `writer` (pack, resumable),
`hub` (downloads), `synth/` (synthetic checkpoints for tests, demos and benchmarks).
Names are loaded on first use: the writer pulls in mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qpack.log_default import log_to_stderr_by_default
from qpack.mlx_lm_package import register_without_init

log_to_stderr_by_default()  # not stdout, where generated text goes
register_without_init()  # mlx-lm's models without transformers (~210 MiB)

if TYPE_CHECKING:
    from qpack.reader import Container
    from qpack.reader import verify_container as verify
    from qpack.spec import QpackError
    from qpack.writer import pack

__all__ = ["Container", "QpackError", "pack", "verify"]

_WHERE = {
    "Container": ("qpack.reader", "Container"),
    "QpackError": ("qpack.spec", "QpackError"),
    "pack": ("qpack.writer", "pack"),
    "verify": ("qpack.reader", "verify_container"),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'qpack' has no attribute {name!r}")
    module, attr = _WHERE[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
