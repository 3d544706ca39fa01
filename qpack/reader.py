"""The container reader: open and validate a `.qpack`, then one pread per expert.

Everything that can be checked without reading the payload is checked at open, so a
truncated, foreign, newer or hand-edited container fails there with an error naming
the file and the problem. Expert payloads are checked by crc32 on first use (or all
at open with verify="full"): no reader ever hands out garbage weights silently.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import zlib

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # the module or None: callers check
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

import mlx.core as mx
import msgspec
import numpy as np
import structlog

from qpack import spec
from qpack.checked_files import check_listed, non_expert_files, tokenizer_dir
from qpack.families import canonical, family
from qpack.manifest_checks import check_files, check_layers
from qpack.safetensors_io import load_safetensors
from qpack.spec import QpackError

log = structlog.get_logger("qpack.reader")
# What each level checks (sha256 of a file, crc32 of an expert blob):
#   "off":       nothing (structure and sizes only, as at every level)
#   "first-use": config, tokenizer files and dense core at open; each expert the first
#                time it is read (the default)
#   "full":      every file and every expert at open (reads the whole container)
#   "always":    as first-use, plus every expert on every read (a crc32 pass per read)
Verify = Literal["off", "first-use", "full", "always"]
ALIGN_BYTES = 4096  # O_DIRECT buffer alignment: the largest logical block size in common use
_NP_DTYPES = {"uint32": np.uint32, "uint8": np.uint8, "bfloat16": np.uint16, "float16": np.float16,
              "float32": np.float32}


class ExpertCorrupt(QpackError):
    """An expert's bytes do not match the checksum recorded at pack time."""


class ExpertIO(Protocol):
    """Positional read into a caller buffer; returns the byte count (0 at EOF)."""

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int: ...


class PosixIO:
    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)


def aligned_empty(nbytes: int, align: int = ALIGN_BYTES) -> np.ndarray:
    """An uninitialised uint8 buffer whose start is `align`-aligned (for O_DIRECT reads)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]


class Container:
    def __init__(self, root: Path, manifest: spec.Manifest, config: dict, verify: Verify,
                 io: ExpertIO, o_direct: bool = False) -> None:
        self.root = root
        # O_DIRECT bypasses the page cache (honest disk numbers on a host whose RAM would
        # cache every expert); it needs buffers and offsets aligned to the block size,
        # which strides are (ALIGNMENT) and the reader's staging buffers are (ALIGN_BYTES).
        self.o_direct = o_direct
        self.manifest = manifest
        self.config = config
        self.verify = verify
        self.io = io
        # The MTP head's experts (index num_layers) are read like a layer's, but are not one
        # of the model's MoE layers (`moe_layers`).
        self._layers = {entry.index: entry for entry in manifest.expert_entries}
        self._paths = {entry.index: spec.check_relative(root, entry.file) for entry in manifest.expert_entries}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._checked = {i: bytearray(e.num_experts) for i, e in self._layers.items()}

    # -- opening ---------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: Verify = "first-use",
             io: ExpertIO | None = None, o_direct: bool = False) -> Container:
        if verify not in ("off", "first-use", "full", "always"):
            raise ValueError(f"verify must be off, first-use, full or always, not {verify!r}")
        root = Path(path)
        if not root.exists():
            raise QpackError(root, "no such container")
        if not root.is_dir():
            raise QpackError(root, "not a container directory (a .qpack is a directory)")
        manifest = load_manifest(root)
        config = _load_config(root, manifest)
        check_files(root, manifest)
        check_layers(root, manifest)
        _check_config_matches(root, manifest, config)
        container = cls(root, manifest, config, verify, io or PosixIO(), o_direct)
        if verify in ("first-use", "always"):
            # Config, tokenizer and dense core are each read once, so they are checked once,
            # here (sha256 runs at ~2 GB/s); the experts are checked by crc32 as they are read.
            check_listed(root, manifest, non_expert_files(manifest))
        if verify == "full":
            report = verify_container(root)
            if not report.ok:
                raise QpackError(root, "verification failed: " + "; ".join(report.problems[:5]))
            for bits in container._checked.values():
                bits[:] = b"\x01" * len(bits)
        return container

    # -- dense core --------------------------------------------------------------
    @property
    def dense_path(self) -> Path:
        return self.root / spec.DENSE

    def tokenizer_dir(self) -> Path:
        """Where to load the tokenizer from: only the manifest's tokenizer files (checked)."""
        return tokenizer_dir(self.root, self.manifest, verify=self.verify != "off")

    def dense_weights(self) -> dict[str, mx.array]:
        return load_safetensors(self.dense_path)

    # -- experts -----------------------------------------------------------------
    def layer(self, layer_index: int) -> spec.LayerEntry:
        entry = self._layers.get(layer_index)
        if entry is None:
            raise KeyError(f"layer {layer_index} has no routed experts in {self.root} (MoE layers: {sorted(self._layers)})")
        return entry

    @property
    def moe_layers(self) -> list[int]:
        return sorted(e.index for e in self.manifest.layers)

    def _fd(self, layer_index: int) -> int:
        fd = self._fds.get(layer_index)
        if fd is None:
            with self._lock:
                fd = self._fds.get(layer_index)
                if fd is None:
                    fd = self._fds[layer_index] = self._open_layer(self._paths[layer_index])
        return fd

    def _open_layer(self, path: Path) -> int:
        if self.o_direct:
            try:
                return open_uncached(path)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("reader.o_direct_unsupported", path=str(path), error=str(exc))
                self.o_direct = False  # e.g. tmpfs: fall back to buffered reads, once
        return os.open(path, os.O_RDONLY)

    def read_expert(self, layer_index: int, expert: int, out: memoryview | bytearray | np.ndarray, *,
                    check: bool = True) -> None:
        """Read one expert blob into `out` (writable bytes, at least nbytes long; a full
        stride when it fits, so the read stays one aligned request). `check=False` leaves
        the crc32 to a later `check_expert` (the reader runs it off the disk's path)."""
        entry = self.layer(layer_index)
        if not 0 <= expert < entry.num_experts:
            raise IndexError(f"layer {layer_index}: expert {expert} out of range 0..{entry.num_experts - 1}")
        view = memoryview(out).cast("B") if not isinstance(out, memoryview) or out.format != "B" else out
        if view.readonly:
            raise ValueError("read_expert needs a writable buffer")
        nbytes = entry.format.nbytes
        if len(view) < nbytes:
            raise ValueError(f"buffer of {len(view)} bytes is smaller than the expert ({nbytes} bytes)")
        fd, offset, want, _ = self.expert_extent(layer_index, expert, len(view))
        got = 0
        while got < want:
            n = self.io.pread_into(fd, view[got:want], offset + got)
            if n <= 0:
                break
            got += n
        if got < nbytes:
            raise QpackError(self._paths[layer_index],
                             f"layer {layer_index} expert {expert}: short read ({got} of {nbytes} bytes at {offset}); file truncated?")
        if check:
            self.check_expert(layer_index, expert, view)

    def expert_extent(self, layer_index: int, expert: int, room: int) -> tuple[int, int, int, int]:
        """Where one expert's read goes, for a buffer of `room` bytes: (fd, offset, bytes to
        ask for: a whole stride where it fits, so the read stays one aligned request, and
        the blob's own bytes, the least a read must return)."""
        entry = self.layer(layer_index)
        nbytes = entry.format.nbytes
        want = entry.stride if room >= entry.stride else nbytes
        return self._fd(layer_index), expert * entry.stride, want, nbytes

    @property
    def plain_io(self) -> bool:
        """Whether reads go through the OS as they are (no `ExpertIO` of a test or tool
        between): what lets an io_uring read the files itself."""
        return type(self.io) is PosixIO

    def needs_check(self, layer_index: int, expert: int) -> bool:
        """Whether the verify level wants this expert's crc32 checked on this read."""
        return self.verify == "always" or (
            self.verify == "first-use" and not self._checked[layer_index][expert]
        )

    def check_expert(self, layer_index: int, expert: int, buf: memoryview | np.ndarray) -> None:
        """The crc32 check `read_expert` does, for a blob already read (if the level wants it)."""
        if not self.needs_check(layer_index, expert):
            return
        entry = self.layer(layer_index)
        view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
        crc = zlib.crc32(view[: entry.format.nbytes])
        if crc != entry.checksums[expert]:
            raise ExpertCorrupt(self._paths[layer_index],
                                f"layer {layer_index} expert {expert}: crc32 {crc:08x} != {entry.checksums[expert]:08x} "
                                "recorded at pack time (corrupted on disk?)")
        self._checked[layer_index][expert] = 1

    def expert_views(self, buf: memoryview | np.ndarray, layer_index: int | None = None) -> dict[str, np.ndarray]:
        """Each tensor of an expert blob as a numpy view into `buf` (bfloat16 as uint16)."""
        entry = self.layer(layer_index if layer_index is not None else self.moe_layers[0])
        return expert_views(entry.format, buf)

    # -- sizes -------------------------------------------------------------------
    @property
    def smallest_pool_bytes(self) -> int:
        """Smallest workable pool for decode: one layer's top-k experts resident at once."""
        return self.manifest.top_k * self.manifest.pool_slot_bytes

    def prefill_pool_bytes(self, chunk_tokens: int) -> int:
        """Smallest pool for a prefill chunk: every expert the chunk can route to in one layer."""
        return min(self.manifest.num_experts, chunk_tokens * self.manifest.top_k) * self.manifest.pool_slot_bytes

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_uncached(path: Path) -> int:
    """A read-only descriptor whose reads bypass the page cache: O_DIRECT on Linux,
    F_NOCACHE on macOS (which has no O_DIRECT; untested here: no Mac in CI). Raises
    OSError(EINVAL) where neither exists or the filesystem refuses (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        return os.open(path, os.O_RDONLY | flag)
    nocache = getattr(fcntl, "F_NOCACHE", None) if fcntl is not None else None
    if nocache is None:
        raise OSError(errno.EINVAL, "neither O_DIRECT nor F_NOCACHE is available on this platform")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, nocache, 1)
    except OSError:
        os.close(fd)
        raise
    return fd


def expert_views(fmt: spec.ExpertFormat, buf: memoryview | np.ndarray) -> dict[str, np.ndarray]:
    raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).reshape(-1)
    if raw.size < fmt.nbytes:
        raise ValueError(f"buffer of {raw.size} bytes is smaller than the expert ({fmt.nbytes} bytes)")
    return {t.name: raw[t.offset : t.offset + t.nbytes].view(_NP_DTYPES[t.dtype]).reshape(t.shape) for t in fmt.tensors}


def load_manifest(root: Path) -> spec.Manifest:
    path = root / spec.MANIFEST
    if not path.is_file():
        if ((root / "config.json").is_file() and not (root / spec.JOURNAL).exists()
                and not (root / spec.DENSE).exists() and not (root / spec.EXPERTS_DIR).exists()):
            # A checkpoint where a container was meant (a container's own files, or a pack's
            # journal, mark a partial container).
            raise QpackError(root, "is a checkpoint directory, not a .qpack container; pack it "
                             f"first: moestream pack {root} -o {root.name}.qpack")
        raise QpackError(root, "incomplete container (no manifest.json); re-run pack to resume")
    data = path.read_bytes()
    raw = spec.parse_json(data, path, "qpack manifest")
    if not isinstance(raw, dict) or raw.get("magic") != spec.MAGIC:
        magic = raw.get("magic") if isinstance(raw, dict) else None
        raise QpackError(path, f"not a qpack container (magic {magic!r}, expected {spec.MAGIC!r})")
    version = raw.get("version")
    if not isinstance(version, int) or version < 1:
        raise QpackError(path, f"container version {version!r} is not a valid version")
    if version > spec.VERSION:
        raise QpackError(path, f"container version {version} is newer than this moestream supports ({spec.VERSION})")
    return spec.decode_manifest(data, path)


def _load_config(root: Path, manifest: spec.Manifest) -> dict:
    path = root / spec.CONFIG
    if not path.is_file():
        raise QpackError(path, "config.json is missing")
    config = spec.parse_json(path.read_bytes(), path, "config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if canonical(model_type) != manifest.model_type:
        raise QpackError(path, f"config.json model_type {model_type!r} does not match the manifest's {manifest.model_type!r}")
    return config


def _check_config_matches(root: Path, m: spec.Manifest, config: dict) -> None:
    """The model config must describe the packed weights, and text must be encodable."""
    fam = family(m.model_type)
    text = fam.text_config(config)
    for key, want in (("num_hidden_layers", m.num_layers), (fam.experts_key, m.num_experts),
                      ("num_experts_per_tok", m.top_k)):
        if text.get(key) != want:
            raise QpackError(root / spec.CONFIG, f"config.json {key} = {text.get(key)!r} does not match the manifest's {want}")
    if not (root / "tokenizer.json").is_file():
        raise QpackError(root / "tokenizer.json", "tokenizer.json is missing: the container cannot encode text")


class VerifyReport(msgspec.Struct):
    path: str
    problems: list[str] = []
    files_checked: int = 0
    experts_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_container(path: str | os.PathLike[str],
                     progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Full check: structure, every file's sha256 and every expert's crc32.

    Collects every problem instead of stopping at the first. `progress(done, total)` is
    called with bytes checked so far (the container is read about twice)."""
    root = Path(path)
    report = VerifyReport(str(root))
    try:
        container = Container.open(root, verify="off")
    except QpackError as exc:
        report.problems.append(str(exc))
        return report
    with container:
        m = container.manifest
        total = sum(f.size for f in m.files) + sum(e.stride * e.num_experts for e in m.expert_entries)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        unreadable: set[str] = set()  # listed once, not once per expert, and still listing the rest
        for f in m.files:
            h = hashlib.sha256()
            try:
                with open(root / f.path, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        h.update(chunk)
                        advance(len(chunk))
            except OSError as exc:
                unreadable.add(f.path)
                report.problems.append(f"{root / f.path}: cannot read: {exc.strerror or exc}")
                continue
            report.files_checked += 1
            if h.hexdigest() != f.sha256:
                report.problems.append(f"{root / f.path}: sha256 {h.hexdigest()[:16]}... != manifest {f.sha256[:16]}...")
        for entry in m.expert_entries:
            if entry.file in unreadable:
                continue
            buf = bytearray(entry.stride)
            for e in range(entry.num_experts):
                try:
                    container.read_expert(entry.index, e, buf)
                except OSError as exc:
                    report.problems.append(f"{root / entry.file}: layer {entry.index} expert {e}: "
                                           f"cannot read: {exc.strerror or exc}")
                    break
                advance(entry.stride)
                report.experts_checked += 1
                crc = zlib.crc32(memoryview(buf)[: entry.format.nbytes])
                if crc != entry.checksums[e]:
                    report.problems.append(f"{root / entry.file}: layer {entry.index} expert {e}: crc32 {crc:08x} "
                                           f"!= {entry.checksums[e]:08x}")
    return report
