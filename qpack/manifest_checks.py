"""What a manifest must say before any byte of the container is trusted: files inside the
container with sane sizes, layers whose expert formats and strides add up, and
quantized tensors whose shapes fit their bits and groups (so compute never meets a lie)."""

from __future__ import annotations

import math
from pathlib import Path

from qpack import spec
from qpack.spec import QpackError


def check_files(root: Path, manifest: spec.Manifest) -> None:
    listed = set()
    for f in manifest.files:
        path = spec.check_relative(root, f.path)
        if f.path in listed:
            raise QpackError(root / spec.MANIFEST, f"file {f.path!r} is listed twice")
        listed.add(f.path)
        try:  # a listed name can be too long for the filesystem (ENAMETOOLONG), etc.
            size = path.stat().st_size if path.is_file() else None
        except OSError as exc:
            raise QpackError(path, f"listed in the manifest but cannot be read: {exc.strerror}") from None
        if size is None:
            raise QpackError(path, "listed in the manifest but missing")
        if size != f.size:
            raise QpackError(path, f"is {size} bytes, manifest says {f.size} (truncated or replaced)")
    for required in (spec.CONFIG, spec.DENSE):
        if required not in listed:
            raise QpackError(root / spec.MANIFEST, f"manifest does not list {required}")
    dense = next(f for f in manifest.files if f.path == spec.DENSE)
    if dense.size != manifest.dense_bytes:
        raise QpackError(root / spec.MANIFEST, f"dense_bytes {manifest.dense_bytes} != size of {spec.DENSE} ({dense.size})")


def check_layers(root: Path, m: spec.Manifest) -> None:
    where = root / spec.MANIFEST
    if m.alignment <= 0 or m.alignment % spec.TENSOR_ALIGNMENT:
        raise QpackError(where, f"alignment {m.alignment} is not a positive multiple of {spec.TENSOR_ALIGNMENT}")
    if not 0 < m.top_k <= m.num_experts:
        raise QpackError(where, f"top_k {m.top_k} is not within 1..num_experts ({m.num_experts})")
    sizes = {f.path: f.size for f in m.files}
    seen: set[int] = set()
    if m.mtp_experts is not None and (m.mtp_layers != 1 or m.mtp_experts.index != m.num_layers):
        raise QpackError(where, f"mtp_experts: index {m.mtp_experts.index} with mtp_layers "
                         f"{m.mtp_layers}; the MTP head's experts are layer {m.num_layers} of a head")
    for entry in m.expert_entries:
        name = f"layer {entry.index}" if entry is not m.mtp_experts else "mtp_experts"
        if entry is not m.mtp_experts and (entry.index in seen or not 0 <= entry.index < m.num_layers):
            raise QpackError(where, f"{name}: index duplicated or outside 0..{m.num_layers - 1}")
        seen.add(entry.index)
        spec.check_relative(root, entry.file)
        if entry.file not in sizes:
            raise QpackError(where, f"{name}: file {entry.file!r} is not in the files list")
        if entry.num_experts != m.num_experts or len(entry.checksums) != entry.num_experts:
            raise QpackError(where, f"{name}: {entry.num_experts} experts, {len(entry.checksums)} checksums, "
                             f"manifest num_experts {m.num_experts}")
        _check_format(where, name, entry.format)
        if entry.stride < entry.format.nbytes:
            raise QpackError(where, f"{name}: stride {entry.stride} is smaller than the expert format's {entry.format.nbytes} bytes")
        if entry.stride % m.alignment:
            raise QpackError(where, f"{name}: stride {entry.stride} is not a multiple of the alignment {m.alignment}")
        if entry.num_experts * entry.stride != sizes[entry.file]:
            raise QpackError(root / entry.file, f"{name}: {entry.num_experts} experts x stride {entry.stride} = "
                             f"{entry.num_experts * entry.stride} bytes, but the file is {sizes[entry.file]}")


def _check_format(where: Path, name: str, fmt: spec.ExpertFormat) -> None:
    end = 0
    for t in sorted(fmt.tensors, key=lambda t: t.offset):
        # Python ints: numpy's int64 product wraps around on absurd shapes.
        if any(d < 0 for d in t.shape) or t.nbytes != spec.DTYPE_SIZES[t.dtype] * math.prod(t.shape):
            raise QpackError(where, f"{name}: tensor {t.name} {t.dtype}{list(t.shape)} cannot be {t.nbytes} bytes")
        if t.offset < 0:
            raise QpackError(where, f"{name}: tensor {t.name} has negative offset {t.offset}")
        if t.offset < end:
            raise QpackError(where, f"{name}: tensor {t.name} at offset {t.offset} overlaps the previous tensor (ends at {end})")
        end = t.offset + t.nbytes
    if end > fmt.nbytes:
        raise QpackError(where, f"{name}: tensors end at {end}, past the format's nbytes {fmt.nbytes}")
    names = [t.name for t in fmt.tensors]
    for proj in spec.PROJECTIONS:
        if f"{proj}.weight" not in names:
            raise QpackError(where, f"{name}: expert format has no {proj}.weight")
        _check_quant(where, f"{name} {proj}", fmt, proj)
        w, bias = fmt.tensor(f"{proj}.weight"), next((t for t in fmt.tensors if t.name == f"{proj}.bias"), None)
        if bias is not None and (len(bias.shape) != 1 or not w.shape or bias.shape[0] != w.shape[0]):
            raise QpackError(where, f"{name} {proj}: bias {list(bias.shape)} does not fit its weight's rows")


def _check_quant(where: Path, name: str, fmt: spec.ExpertFormat, proj: str) -> None:
    """A projection's tensors fit its quantization, so compute never meets a lie."""
    by_name = {t.name: t for t in fmt.tensors}
    w, scales, biases = (by_name.get(f"{proj}.{p}") for p in ("weight", "scales", "biases"))
    bits, group_size, mode = fmt.quant(proj)
    if bits is None:
        if scales is not None or biases is not None:
            raise QpackError(where, f"{name}: has scales/biases but its format is not quantized")
        return
    if mode not in spec.QUANT_MODES or not group_size or group_size <= 0 or not 0 < bits <= 8:
        raise QpackError(where, f"{name}: quantization {bits}-bit {mode!r} in groups of {group_size} "
                         f"is not one of {spec.QUANT_MODES} at 1-8 bits")
    fits = (
        w is not None and scales is not None and w.dtype == "uint32" and len(w.shape) == 2
        and scales.shape[:-1] == w.shape[:-1]
        and w.shape[-1] * 32 == scales.shape[-1] * group_size * bits
        and (biases is not None) == (mode == "affine")
        and (biases is None or biases.shape == scales.shape)
    )
    if not fits:
        raise QpackError(where, f"{name}: tensors do not fit {bits}-bit {mode} in groups of {group_size}")
