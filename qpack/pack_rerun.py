"""A pack run that finds a finished container in its output: the same pack (returned as
it is) or another one (refused: a re-run with other options must not get the old
container back). A half-done pack's journal is checked the same way (qpack/writer.py)."""

from __future__ import annotations

from pathlib import Path

from qpack import spec


def finished_differs(manifest: spec.Manifest, source: str, bits: int | None, group_size: int,
                      mode: str) -> dict[str, tuple[object, object]]:
    """What a finished container says against what a pack asks: {option: (there, asked)}.
    The source as given; bits, group size and mode where bits are asked (None keeps a
    quantized source as it is, which the manifest cannot tell from a default)."""
    q = manifest.quantization
    there: dict[str, object] = {"source": manifest.source}
    asked: dict[str, object] = {"source": source}
    if Path(source).is_dir() and Path(manifest.source).is_dir():  # ./src and src alike
        there["source"], asked["source"] = Path(manifest.source).resolve(), Path(source).resolve()
    if bits == 16:
        there["bits"], asked["bits"] = q.bits, None
    elif bits is not None:
        there.update(bits=q.bits, group_size=q.group_size, mode=q.mode or "affine")
        asked.update(bits=bits, group_size=group_size, mode=mode)
    return {k: (there[k], asked[k]) for k in asked if there[k] != asked[k]}
