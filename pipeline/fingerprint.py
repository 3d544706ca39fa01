"""What the model state a container produces depends on: the container and the code.

`system_fingerprint` in OpenAI replies reports it (OpenAI: "the backend configuration the
model runs with"), and state kept across processes (the on-disk prefix cache) is keyed
by it, so state from another container, another moestream, MLX or mlx-lm, or another
forward pass (pipeline/models/) is never used.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

from qpack.spec import MANIFEST


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _sources() -> list[tuple[str, Path]]:
    """The forward pass's source files, by their path under pipeline/models (the
    families' forward code, in a folder of its own, included)."""
    models = Path(__file__).parent / "models"
    return [(p.relative_to(models).as_posix(), p) for p in sorted(models.rglob("*.py"))]


@functools.cache
def _code() -> bytes:
    """The versions, and the source of the forward pass (what computes a state, so a
    change there is a new version even within one release)."""
    digest = hashlib.sha256()
    for package in ("moestream", "mlx", "mlx-lm"):
        digest.update(f"\0{package}={_version(package)}".encode())
    for name, source in _sources():
        digest.update(name.encode() + b"\0" + source.read_bytes())
    return digest.digest()


@functools.lru_cache(maxsize=8)
def _of(manifest: str, stamp: int) -> str:
    digest = hashlib.sha256(Path(manifest).read_bytes())  # lists every file's sha256
    digest.update(_code())
    return "fp_" + digest.hexdigest()[:16]


def fingerprint(root: Path) -> str:
    """`fp_` and 16 hex digits naming a container's manifest and the code (`_code`)."""
    manifest = Path(root) / MANIFEST
    return _of(str(manifest), manifest.stat().st_mtime_ns)
