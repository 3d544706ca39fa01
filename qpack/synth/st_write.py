"""Streaming safetensors writer: tensors are produced chunk by chunk, so a file of any size
is written with one chunk in memory.

The format is trivial (8-byte little-endian header length, a JSON header with dtype, shape and
data offsets per tensor, then the raw bytes), and writing it ourselves gives us bfloat16 from
numpy (which has no bf16 dtype) without an extra dependency.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qpack.milestones import milestone
from qpack.safetensors_io import header_bytes

# safetensors dtype tag -> bytes per element
ST_DTYPE_SIZES: dict[str, int] = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "I32": 4,
    "I64": 8,
    "F8_E4M3": 1,
}

# our dtype names (qpack.spec.DType) -> safetensors tags
ST_DTYPES: dict[str, str] = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "uint32": "U32",
    "uint8": "U8",
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its bytes come from `chunks()`, in row-major order."""

    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray | bytes]]

    @property
    def nbytes(self) -> int:
        n = ST_DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _check_dtypes(entries: Sequence[TensorEntry]) -> Sequence[TensorEntry]:
    for e in entries:
        if e.dtype not in ST_DTYPE_SIZES:
            raise ValueError(f"tensor {e.name!r}: unsupported safetensors dtype {e.dtype!r}")
    return entries


def write_safetensors(
    path: Path,
    entries: Sequence[TensorEntry],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `entries` to `path` (via a temporary file and rename); returns the file size.

    Raises ValueError naming the tensor whose chunks do not add up to its declared size.
    """
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{path}: duplicate tensor names {dup}")
    tmp = path.with_name(path.name + ".partial")
    try:
        size = _write_entries(tmp, path, entries, metadata)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no .partial left behind a failure
        raise
    os.replace(tmp, path)
    return size


def _write_entries(tmp: Path, path: Path, entries: Sequence[TensorEntry],
                   metadata: dict[str, str] | None) -> int:
    with open(tmp, "wb") as f:
        # Unsorted: the JSON lists the tensors in file order, as synth has always written it.
        f.write(header_bytes(_check_dtypes(entries), metadata, sort_keys=False))
        milestone(f"begin {path.name}")
        for e in entries:
            written = 0
            for chunk in e.chunks():
                buf = chunk if isinstance(chunk, bytes) else np.ascontiguousarray(chunk).data
                f.write(buf)
                written += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            if written != e.nbytes:
                raise ValueError(
                    f"{path}: tensor {e.name!r} {e.dtype}{list(e.shape)} produced {written} bytes, "
                    f"expected {e.nbytes}"
                )
        return f.tell()


def plan_shards(entries: Sequence[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """Group entries, in order, into shards of at most `max_bytes` (a bigger tensor gets its own)."""
    shards: list[list[TensorEntry]] = []
    current: list[TensorEntry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        shards.append(current)
    return shards


def write_sharded(
    out: Path,
    entries: Sequence[TensorEntry],
    max_shard_bytes: int,
    metadata: dict[str, str] | None = None,
    on_shard: Callable[[int, int, list[TensorEntry]], None] | None = None,
) -> dict[str, Any]:
    """Write HF-style `model-0000i-of-0000N.safetensors` shards and `model.safetensors.index.json`.

    Returns the index (also written). `on_shard(i, n, entries)` is called before each shard.
    """
    shards = plan_shards(entries, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        if on_shard is not None:
            on_shard(i, n, shard)
        write_safetensors(out / name, shard, metadata)
        for e in shard:
            weight_map[e.name] = name
            total += e.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index
