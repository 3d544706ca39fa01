"""The `.qpack` container, version 1: the manifest schema and the expert blob layout.

A container is a directory (so it downloads and resumes file by file):

    model.qpack/
      manifest.json            written last, by atomic rename
      config.json              the source config, plus an mlx-lm `quantization` block
      tokenizer.json, tokenizer_config.json, chat_template.jinja (when the source has them)
      dense.safetensors        every tensor except the routed experts, in mlx-lm's names
                               (after the model's `sanitize`), quantized as mlx-lm would
      experts/layer_NNN.bin    expert e of that layer at offset e * stride
      mtp.safetensors          the checkpoint's MTP head, dense part (optional, qpack/mtp.py)
      experts/mtp_000.bin      the MTP head's routed experts, as a layer's (`mtp_experts`)

One expert blob holds gate_proj, up_proj, down_proj, each as weight | scales | biases
(affine), weight | scales (mxfp4, nvfp4, mxfp8) or weight alone (unquantized), then the
projection's own additive `bias` where the family has one (gpt-oss), every tensor starting on a 64-byte boundary
inside the blob. The stride is the blob size rounded up to `alignment` (16 KiB), so one
expert is one aligned read and O_DIRECT is possible.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import msgspec

MAGIC = "QPACK"
VERSION = 1
ALIGNMENT = 16 * 1024
TENSOR_ALIGNMENT = 64
MANIFEST = "manifest.json"
JOURNAL = ".qpack-journal.json"  # a pack in progress (qpack/writer.py): a partial container
CONFIG = "config.json"
DENSE = "dense.safetensors"
EXPERTS_DIR = "experts"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")  # MLX modes; affine alone has biases

DType = Literal["uint32", "uint8", "bfloat16", "float16", "float32"]
DTYPE_SIZES: dict[str, int] = {
    "uint32": 4,
    "uint8": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
}


class QpackError(Exception):
    """A container (or a source checkpoint) that cannot be used; names the file and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def parse_json(data: bytes, path: Path, what: str) -> Any:
    """JSON from a file's bytes; what is not JSON is a QpackError naming the file and `what`."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise QpackError(path, f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested past the interpreter's recursion limit
        raise QpackError(path, f"nested too deeply to be a valid {what}") from None


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor inside an expert blob, e.g. `gate_proj.scales`."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class ProjectionQuant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A projection quantized otherwise than its layer (mlx-lm's mixed-precision recipes
    give down_proj more bits); bits None: that projection is not quantized."""

    name: str  # gate_proj | up_proj | down_proj
    bits: int | None
    group_size: int | None
    mode: str | None


class ExpertFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one layer's experts are laid out and quantized; identical for every expert of it."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int
    bits: int | None = None  # None: unquantized (weight only)
    group_size: int | None = None
    mode: str | None = None  # MLX quantization mode: affine, mxfp4, nvfp4, mxfp8
    projections: tuple[ProjectionQuant, ...] = ()  # where a projection differs from the above

    def quant(self, proj: str) -> tuple[int | None, int | None, str | None]:
        """(bits, group_size, mode) of one projection."""
        for p in self.projections:
            if p.name == proj:
                return p.bits, p.group_size, p.mode
        return self.bits, self.group_size, self.mode

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


class LayerEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    index: int  # decoder layer index in the model
    file: str  # relative to the container root
    num_experts: int
    stride: int
    format: ExpertFormat
    checksums: tuple[int, ...]  # crc32 of each expert's nbytes (padding excluded)


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    size: int
    sha256: str


class Quantization(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    bits: int | None  # None: unquantized container
    group_size: int | None
    mode: str | None
    overrides: dict[str, dict[str, int | str]] = {}  # module path -> {bits, group_size}


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    magic: str
    version: int
    source: str
    model_type: str
    num_layers: int
    num_experts: int
    top_k: int
    quantization: Quantization
    alignment: int
    checksum: Literal["crc32"]
    dense_bytes: int
    layers: tuple[LayerEntry, ...]
    files: tuple[FileEntry, ...]
    created_by: str = "moestream"
    # The checkpoint's MTP head, kept in qpack.mtp.MTP_FILE (0: none; older containers).
    mtp_layers: int = 0
    # The head's routed experts in the expert format, streamed like a layer's; its index
    # is num_layers (the layer after the last). None with mtp_layers 1: a container packed
    # before they were streamed, whose MTP_FILE holds them too (held resident).
    mtp_experts: LayerEntry | None = None

    @property
    def expert_entries(self) -> tuple[LayerEntry, ...]:
        """Every expert file's entry: the model's layers, then the MTP head's."""
        return self.layers + ((self.mtp_experts,) if self.mtp_experts is not None else ())

    @property
    def expert_bytes(self) -> int:
        return sum(layer.stride * layer.num_experts for layer in self.layers)

    @property
    def max_stride(self) -> int:
        return max((layer.stride for layer in self.layers), default=0)

    @property
    def pool_slot_bytes(self) -> int:
        """What one pool slot costs at most: the largest stride, or, when layers differ in
        format (mixed precision), every distinct tensor variant (actors.pool.layout)."""
        variants = {(t.name, t.dtype, tuple(t.shape)): t.nbytes
                    for layer in self.layers for t in layer.format.tensors}
        return max(self.max_stride, sum(variants.values()))

    def layer(self, index: int) -> LayerEntry:
        for entry in self.expert_entries:
            if entry.index == index:
                return entry
        raise KeyError(index)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def layer_file(index: int) -> str:
    return f"{EXPERTS_DIR}/layer_{index:03d}.bin"


MTP_EXPERTS_FILE = f"{EXPERTS_DIR}/mtp_000.bin"  # the MTP head's routed experts


def expert_format(
    shapes: dict[str, tuple[tuple[int, ...], str]],
    bits: int | None,
    group_size: int | None,
    mode: str | None,
    projections: tuple[ProjectionQuant, ...] = (),
) -> ExpertFormat:
    """Lay out an expert's tensors (name -> (shape, dtype)) in PROJECTIONS order."""
    order = [
        f"{proj}.{part}"
        for proj in PROJECTIONS
        for part in ("weight", "scales", "biases", "bias")  # bias: SwitchLinear's own (gpt-oss)
        if f"{proj}.{part}" in shapes
    ]
    tensors = []
    offset = 0
    for name in order:
        shape, dtype = shapes[name]
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        offset = round_up(offset, TENSOR_ALIGNMENT)
        # `dtype` is a DType name (DTYPE_SIZES above raised KeyError for any other).
        tensors.append(TensorSpec(name, dtype, tuple(shape), offset, nbytes))  # type: ignore[arg-type]
        offset += nbytes
    return ExpertFormat(tuple(tensors), offset, bits, group_size, mode, projections)


def check_relative(root: Path, rel: str) -> Path:
    """Resolve a manifest path, refusing anything that would leave the container."""
    if (
        not rel
        or "\x00" in rel
        or os.path.isabs(rel)
        or "\\" in rel
        or any(p in ("..", "") for p in rel.split("/"))
    ):
        raise QpackError(root / MANIFEST, f"path {rel!r} is not a plain relative path inside the container")
    path = (root / rel).resolve()
    if root.resolve() not in path.parents:
        raise QpackError(root / MANIFEST, f"path {rel!r} points outside the container")
    return path


encode_manifest = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder(Manifest)


def decode_manifest(data: bytes, path: Path) -> Manifest:
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise QpackError(path, f"manifest does not match the qpack v{VERSION} schema: {exc}") from None
    except msgspec.DecodeError as exc:
        raise QpackError(path, f"manifest is not valid JSON: {exc}") from None
