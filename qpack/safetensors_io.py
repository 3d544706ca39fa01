"""Streaming safetensors access: parse the header, pread one tensor (or one slice of
its leading axis) at a time, and write a file tensor by tensor.

Nothing here maps or loads a whole file, so packing a checkpoint of any size keeps a
flat memory profile: the largest thing ever held is one tensor. bfloat16 goes through
uint16 views because numpy has no bfloat16; no torch needed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, cast

import mlx.core as mx
import msgspec
import numpy as np

from qpack.spec import QpackError

# safetensors dtype tag -> (numpy storage dtype, mlx dtype, spec dtype name)
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype, str]] = {
    "BF16": (np.dtype(np.uint16), mx.bfloat16, "bfloat16"),
    "F16": (np.dtype(np.float16), mx.float16, "float16"),
    "F32": (np.dtype(np.float32), mx.float32, "float32"),
    "U32": (np.dtype(np.uint32), mx.uint32, "uint32"),
    "U8": (np.dtype(np.uint8), mx.uint8, "uint8"),
    "I32": (np.dtype(np.int32), mx.int32, "int32"),
    "I64": (np.dtype(np.int64), mx.int64, "int64"),
    "BOOL": (np.dtype(np.bool_), mx.bool_, "bool"),
    # float8 e4m3 bytes (FP8 checkpoints): read as uint8, decoded by qpack.fp8
    "F8_E4M3": (np.dtype(np.uint8), mx.uint8, "uint8"),
}
_MX_TO_TAG = {v[1]: k for k, v in _DTYPES.items()}
_NAME_TO_TAG = {v[2]: k for k, v in _DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class TensorInfo(msgspec.Struct, frozen=True):
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][0].itemsize

    def row_bytes(self) -> int:
        """Bytes of one entry of the leading axis (one expert of a stacked tensor)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def tag_of(dtype: mx.Dtype) -> str:
    return _MX_TO_TAG[dtype]


def spec_dtype(tag: str) -> str:
    return _DTYPES[tag][2]


def pread_exact(fd: int, length: int, offset: int, path: Path) -> bytearray:
    """pread until `length` bytes arrived; a short file is an error naming the file."""
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise QpackError(path, f"file ends at {offset + got}, expected {length} bytes at {offset}")
        got += n
    return buf


def bytes_to_mx(data: bytes | bytearray | memoryview, tag: str, shape: tuple[int, ...]) -> mx.array:
    np_dtype, dtype, _ = _DTYPES[tag]
    arr = mx.array(np.frombuffer(data, dtype=np_dtype).reshape(shape))
    return arr.view(dtype) if tag == "BF16" else arr


def load_safetensors(path: Path | str) -> dict[str, mx.array]:
    """A .safetensors file's tensors, lazily (`mx.load`). MLX's stubs type `mx.load` for
    every format it reads (an array for .npy, arrays and metadata for .gguf); a
    .safetensors file gives a dict of arrays."""
    return cast(dict[str, mx.array], mx.load(str(path)))


def mx_to_bytes(arr: mx.array) -> memoryview:
    """Raw little-endian bytes of an evaluated array, in row-major order."""
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    data = np.ascontiguousarray(np.asarray(arr))
    return memoryview(data).cast("B")


class SafetensorsFile:
    """One safetensors file: header parsed at open, tensors read on demand by pread."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors, self.metadata = self._parse_header()
        except BaseException:
            os.close(self.fd)
            raise

    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        size = os.fstat(self.fd).st_size
        if size < 8:
            raise QpackError(self.path, f"not a safetensors file ({size} bytes)")
        (hlen,) = struct.unpack("<Q", pread_exact(self.fd, 8, 0, self.path))
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise QpackError(self.path, f"safetensors header length {hlen} is impossible (file {size} bytes)")
        try:
            header = json.loads(pread_exact(self.fd, hlen, 8, self.path))
        except ValueError as exc:
            raise QpackError(self.path, f"safetensors header is not JSON: {exc}") from None
        except RecursionError:
            raise QpackError(self.path, "safetensors header is nested too deeply to be one") from None
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + hlen
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                tag, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise QpackError(self.path, f"tensor {name!r} has a malformed header entry") from None
            if tag not in _DTYPES:
                raise QpackError(self.path, f"tensor {name!r} has unsupported dtype {tag}")
            expected = _DTYPES[tag][0].itemsize * int(np.prod(shape, dtype=np.int64))
            if end - begin != expected or base + end > size or begin < 0:
                raise QpackError(
                    self.path, f"tensor {name!r} data range {begin}..{end} is inconsistent "
                    f"with {tag}{list(shape)} or the file size {size} (truncated?)"
                )
            tensors[name] = TensorInfo(tag, shape, base + begin, end - begin)
        return tensors, metadata

    def read_bytes(self, name: str, row: int | None = None) -> bytearray:
        """The tensor's bytes, or those of entry `row` of its leading axis."""
        info = self.tensors[name]
        if row is None:
            return pread_exact(self.fd, info.nbytes, info.start, self.path)
        if not 0 <= row < info.shape[0]:
            raise QpackError(self.path, f"tensor {name!r} has no row {row} (shape {list(info.shape)})")
        rb = info.row_bytes()
        return pread_exact(self.fd, rb, info.start + row * rb, self.path)

    def read_rows(self, name: str, start: int, stop: int) -> bytearray:
        """Bytes of entries start..stop of the leading axis (contiguous in the file)."""
        info = self.tensors[name]
        if not info.shape:
            return pread_exact(self.fd, info.nbytes, info.start, self.path)
        rb = info.row_bytes()
        return pread_exact(self.fd, rb * (stop - start), info.start + start * rb, self.path)

    def read(self, name: str, row: int | None = None) -> mx.array:
        info = self.tensors[name]
        shape = info.shape if row is None else info.shape[1:]
        return bytes_to_mx(self.read_bytes(name, row), info.dtype, shape)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PlannedTensor(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _DTYPES[self.dtype][0].itemsize * int(np.prod(self.shape, dtype=np.int64))


class HeaderEntry(Protocol):
    """What a header needs of a tensor (PlannedTensor, qpack.st_write.TensorEntry)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...  # safetensors tag
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


# What the packer writes when given no metadata (mlx-lm's own files carry this).
MLX_METADATA: dict[str, str] = {"format": "mlx"}


def header_bytes(
    tensors: Iterable[HeaderEntry],
    metadata: dict[str, str] | None = None,
    *,
    sort_keys: bool = True,
) -> bytes:
    """The 8-byte length plus JSON header for tensors stored contiguously in the given order.

    `__metadata__` is written only when `metadata` is non-empty. `sort_keys` orders the
    JSON keys by name (the packer); False keeps `__metadata__` first, then the tensors in
    order (the synthetic checkpoints). The data offsets follow the given order either way.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, sort_keys=sort_keys, separators=(",", ":")).encode()
    # The reference implementation pads the header with spaces to 8 bytes, so the data
    # section is aligned for zero-copy loaders.
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def data_offsets(plan: list[PlannedTensor]) -> tuple[bytes, dict[str, int], int]:
    """Header bytes, each tensor's absolute file offset, and the file size."""
    header = header_bytes(plan, MLX_METADATA)
    offsets, offset = {}, len(header)
    for t in plan:
        offsets[t.name] = offset
        offset += t.nbytes
    return header, offsets, offset


def open_index(root: Path) -> dict[str, Path]:
    """Tensor name -> shard path for a checkpoint directory (index file or lone shards)."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise QpackError(index, f"bad safetensors index: {exc}") from None
        return {name: root / shard for name, shard in weight_map.items()}
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise QpackError(root, "no *.safetensors files and no model.safetensors.index.json")
    out: dict[str, Path] = {}
    for shard in shards:
        with SafetensorsFile(shard) as f:
            out.update({name: shard for name in f.tensors})
    return out


