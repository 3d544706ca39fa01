"""The token embedding read from the container row by row instead of held resident.

A forward needs one embedding row per token, and the table is most of a big vocabulary's
dense core (Qwen3.5/3.6's 248,320 x 2,048 at 4 bits: 273 MiB of the 35B's 1,325). So the
rows a step needs are read from dense.safetensors with pread (through the page cache,
which is not the process's RSS and which the kernel reclaims under pressure) and
dequantized exactly as mlx-lm's `QuantizedEmbedding` does (`mx.dequantize` of the rows'
packed weights, scales and biases; an unquantized table's rows as they are), so the
hidden states and logits stay bit-identical to the resident model's.

Only an untied embedding is moved: a tied one is also the lm_head, which reads the whole
table every step. The cost is a host read of the token ids: a lazy id (pipelined decode
queues step t+1 on the not-yet-read token t) is evaluated here, so with a file embedding
the next step's graph is built after the current token is known. On the CPU backend that
overlap was the graph's build time; on a GPU it keeps the device busy, so `auto`
(`memory.embedding`) keeps GPUs' tables resident.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import structlog

from qpack.safetensors_io import SafetensorsFile, TensorInfo, bytes_to_mx

log = structlog.get_logger("moestream.embedding")
_PARTS = ("weight", "scales", "biases")


class FileEmbedding(nn.Module):
    """An embedding whose rows stay in a safetensors file: no parameters, one pread per
    distinct token and tensor (the page cache keeps the hot rows)."""

    def __init__(self, path: Path, tensors: dict[str, TensorInfo], quant: dict[str, Any] | None) -> None:
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # closed with the module (GC)  # noqa: SIM115
        # A Module keeps dict attributes as children (parameters, `update`): these are
        # the table's layout, held as plain attributes.
        object.__setattr__(self, "_tensors", tensors)
        object.__setattr__(self, "_quant", quant)  # group_size, bits, mode; None: plain rows
        self.path = path
        self.num_embeddings = tensors["weight"].shape[0]
        # What a row comes out as: the scales' dtype when quantized (as mlx-lm's).
        self.dtype: mx.Dtype = bytes_to_mx(b"", tensors["scales" if quant else "weight"].dtype, (0,)).dtype

    @property
    def file_bytes(self) -> int:
        """The bytes this table keeps out of memory."""
        return sum(t.nbytes for t in self._tensors.values())

    def _rows(self, info: TensorInfo, ids: np.ndarray) -> mx.array:
        row = info.row_bytes()
        buf = bytearray(row * len(ids))
        view = memoryview(buf)
        fd = self._file.fileno()
        for k, i in enumerate(ids.tolist()):
            got = os.preadv(fd, [view[k * row : (k + 1) * row]], info.start + i * row)
            if got != row:
                raise OSError(f"{self.path}: short read of embedding row {i} ({got} of {row} bytes)")
        return bytes_to_mx(buf, info.dtype, (len(ids), *info.shape[1:]))

    def __call__(self, x: mx.array) -> mx.array:
        ids = np.asarray(x)  # evaluates a lazy id: the rows are read on the host
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range 0..{self.num_embeddings - 1}")
        unique, inverse = np.unique(flat, return_inverse=True)
        parts = {name: self._rows(info, unique) for name, info in self._tensors.items()}
        if self._quant is None:
            rows = parts["weight"]
        else:
            rows = mx.dequantize(parts["weight"], scales=parts["scales"], biases=parts.get("biases"),
                                 group_size=self._quant["group_size"], bits=self._quant["bits"],
                                 mode=self._quant["mode"])
        out = rows if len(unique) == flat.size and (unique == flat).all() else rows[mx.array(inverse)]
        return out.reshape(*ids.shape, rows.shape[-1])

    def as_linear(self, x: mx.array) -> mx.array:
        raise TypeError("a tied embedding is the lm_head: it stays resident (FileEmbedding is never tied)")


def embedding_dtype(embed: nn.Module) -> mx.Dtype:
    """The dtype an embedding's rows come out as (a quantized one keeps it in its scales)."""
    if isinstance(embed, FileEmbedding):
        return embed.dtype
    scales = getattr(embed, "scales", None)
    return (scales if scales is not None else embed.weight).dtype


def _path_of(model: nn.Module, module: nn.Module) -> str | None:
    return next((path for path, m in model.named_modules() if m is module), None)


def move_to_file(model: nn.Module, parent: nn.Module, weights: dict[str, mx.array],
                 dense_path: Path) -> FileEmbedding | None:
    """Replace `parent.embed_tokens` (an untied embedding of `model`) by a FileEmbedding
    over the same tensors of `dense_path`, and drop those tensors from `weights` (never
    read: mx.load is lazy). None, and nothing changed, when the table is not one that
    can be read by rows (an unknown embedding class, tensors missing)."""
    embed = parent.embed_tokens
    prefix = _path_of(model, embed)
    if prefix is None or not isinstance(embed, (nn.Embedding, nn.QuantizedEmbedding)):
        return None
    quantized = isinstance(embed, nn.QuantizedEmbedding)
    names = {p: f"{prefix}.{p}" for p in _PARTS if f"{prefix}.{p}" in weights}
    if "weight" not in names or (quantized and "scales" not in names):
        return None
    with SafetensorsFile(dense_path) as f:
        tensors = {p: f.tensors[name] for p, name in names.items()}
    quant = ({"group_size": embed.group_size, "bits": embed.bits, "mode": embed.mode}
             if quantized else None)
    table = FileEmbedding(dense_path, tensors, quant)
    parent.embed_tokens = table
    for name in names.values():
        del weights[name]
    log.info("embedding.on_file", path=str(dense_path), rows=table.num_embeddings,
             mb=round(table.file_bytes / 2**20, 1))
    return table


def _table(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo] | None:
    """The token embedding's tensors in a dense file's header (the shortest
    `...embed_tokens.` prefix: an MTP head's own would be longer), when an lm_head is
    there too: without one the embedding is tied and stays resident."""
    if not any(name.endswith("lm_head.weight") for name in tensors):
        return None
    weights = sorted((n for n in tensors if n.endswith("embed_tokens.weight")), key=len)
    if not weights:
        return None
    prefix = weights[0].removesuffix("weight")
    return {p: tensors[prefix + p] for p in _PARTS if prefix + p in tensors}


def wants_file(setting: str, on_cpu: bool) -> bool:
    """`memory.embedding`: "file", "resident", or "auto" (on file on the CPU backend, whose
    memory is the weights' and the process's; resident on a GPU, where a lazy token would
    cost a host sync per decode step: see the module's docstring)."""
    return setting == "file" or (setting == "auto" and on_cpu)


def table_bytes(tensors: dict[str, TensorInfo]) -> int:
    """The bytes of a dense file (its header's `tensors`) an engine with the embedding on
    file leaves there (0 for a tied embedding)."""
    table = _table(tensors)
    return sum(t.nbytes for t in table.values()) if table else 0
