"""Nothing read that is not checked: a container's non-expert files, as the manifest lists them.

The tokenizer loader (transformers, under mlx-lm) opens whatever it finds in a directory:
a `chat_template.jinja` dropped into a container, or a symlink to one outside it, would
change every prompt while `verify` says OK. So the tokenizer is built from a private
copy holding only the files the manifest lists, each read without following links and
checked against its sha256. The dense core and config are hashed at open too (unless
verify = "off"): they are read once, and a flipped byte there would decode silently.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

from qpack import spec
from qpack.spec import QpackError

CHUNK = 1 << 22
# Files a tokenizer loader may read; only those the manifest lists are ever copied.
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json", "vocab.json",
                   "merges.txt", "added_tokens.json")
_private: Path | None = None


def open_listed(root: Path, rel: str) -> int:
    """A read-only fd of a listed file: inside the container, a regular file, no link on the way."""
    path = spec.check_relative(root, rel)  # refuses paths (and links) that leave the container
    if (root / rel).is_symlink():
        raise QpackError(root / rel, "is a symbolic link; a container holds regular files only")
    try:
        fd = os.open(root / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise QpackError(path, f"cannot open: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise QpackError(path, "is not a regular file")
    return fd


def sha256_fd(fd: int, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with os.fdopen(os.dup(fd), "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


# Files hashed in this process, by what any write to them changes: (device, inode, size,
# mtime, ctime) -> their sha256. An engine reopened on the same container (a server's
# restarted engine, a test's or benchmark's next case) does not hash its dense core again
# (~0.7 s at the 35B's 1.3 GB); a file rewritten, replaced or touched since has another
# key and is hashed anew. A file changed less than `_SETTLED_NS` before its hash is not
# recorded: the kernel stamps times at a clock tick (1-10 ms), so a second write within
# the tick of the first could leave the key as it was (git's "racy" index entries).
# Bounded: the oldest entry goes first. Engines open in threads at once: one lock.
_hashed: dict[tuple[int, int, int, int, int], str] = {}
_hashed_lock = threading.Lock()
_HASHED_MAX = 256
_SETTLED_NS = 2_000_000_000


def _file_sha256(fd: int) -> str:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _hashed.get(key)
    if digest is None:
        digest = sha256_fd(fd)
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= _SETTLED_NS:
            with _hashed_lock:
                if len(_hashed) >= _HASHED_MAX:
                    _hashed.pop(next(iter(_hashed)), None)
                _hashed[key] = digest
    return digest


def check_listed(root: Path, manifest: spec.Manifest, names: Iterable[str]) -> None:
    """sha256 of each named file against the manifest; a mismatch is a QpackError. A file
    this process hashed before, unchanged since, is not read again (`_hashed`)."""
    entries = {f.path: f for f in manifest.files}
    for rel in names:
        fd = open_listed(root, rel)
        try:
            digest = _file_sha256(fd)
        finally:
            os.close(fd)
        if digest != entries[rel].sha256:
            raise QpackError(root / rel, f"sha256 {digest[:16]}... != manifest {entries[rel].sha256[:16]}... "
                             "(changed or corrupted since packing)")


def non_expert_files(manifest: spec.Manifest) -> list[str]:
    """Every listed file but the expert layers (which are checked per expert by crc32)."""
    layer_files = {entry.file for entry in manifest.expert_entries}
    return [f.path for f in manifest.files if f.path not in layer_files]


def tokenizer_dir(root: Path, manifest: spec.Manifest, verify: bool) -> Path:
    """A private directory with the container's listed tokenizer files and nothing else,
    plus a config.json that names only the model type: transformers picks the tokenizer
    class by it (without it a Qwen3.5 tokenizer loads as the generic backend, whose
    `decode(skip_special_tokens=True)` drops the <think> and <tool_call> markup).

    Named by the files' manifest digests and the model type, so engines reopened in one
    process share it (and the tokenizer cache keyed on it), whatever the quantization;
    removed when the process exits."""
    listed = {f.path: f for f in manifest.files if f.path in TOKENIZER_NAMES}
    if "tokenizer.json" not in listed:
        raise QpackError(root / spec.MANIFEST, "manifest does not list tokenizer.json: the container "
                         "cannot encode text")
    config = json.dumps({"model_type": manifest.model_type})
    key = hashlib.sha256("".join(f"{n}:{f.sha256};" for n, f in sorted(listed.items())).encode()
                         + config.encode())
    out = _private_root() / key.hexdigest()[:32]
    if out.is_dir():
        return out
    staging = Path(tempfile.mkdtemp(dir=_private_root()))
    for rel, entry in listed.items():
        fd = open_listed(root, rel)
        try:
            with os.fdopen(os.dup(fd), "rb") as src:
                data = src.read()
        finally:
            os.close(fd)
        if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
            shutil.rmtree(staging, ignore_errors=True)
            raise QpackError(root / rel, "sha256 does not match the manifest (changed or corrupted "
                             "since packing)")
        (staging / rel).write_bytes(data)
    (staging / "config.json").write_text(config)
    try:
        os.replace(staging, out)
    except OSError:  # another thread made it first: same digests, same files
        shutil.rmtree(staging, ignore_errors=True)
    return out


_PREFIX = "moestream-tokenizer-"


def _private_root() -> Path:
    global _private
    if _private is None:
        _remove_orphans()
        _private = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        atexit.register(shutil.rmtree, _private, True)
    return _private


def _remove_orphans() -> None:
    """Copies left by processes that died without running atexit (kill -9), ours only."""
    for old in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*-*"):
        pid = old.name.removeprefix(_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or old.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue


def unreadable_files(root: Path, manifest: spec.Manifest) -> list[str]:
    """Listed files that cannot be opened now or whose size changed since packing: what a
    health check reports (a few stats and opens, no payload read). Named by their path in
    the container: a health answer does not tell a client where the server's files live."""
    problems = []
    for f in manifest.files:
        path = root / f.path
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            problems.append(f"{f.path}: cannot open: {exc.strerror}")
            continue
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != f.size:
            problems.append(f"{f.path}: {size} bytes, manifest says {f.size}")
    return problems


def expert_problem(root: Path, manifest: spec.Manifest, layer: int, expert: int) -> str | None:
    """What is wrong with one expert on disk now (cannot open, short, crc32), or None: a
    health check re-examines an expert that failed a read once its file has changed."""
    entry = manifest.layer(layer)
    path = root / entry.file
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        return f"{path}: cannot open: {exc.strerror}"
    try:
        data = os.pread(fd, entry.format.nbytes, expert * entry.stride)
    except OSError as exc:
        return f"{path}: expert {expert} of layer {layer}: cannot read: {exc.strerror}"
    finally:
        os.close(fd)
    if len(data) < entry.format.nbytes:
        return f"{path}: expert {expert} of layer {layer}: cut short ({len(data)} of {entry.format.nbytes} bytes)"
    crc = zlib.crc32(data)
    if crc != entry.checksums[expert]:
        return f"{path}: expert {expert} of layer {layer}: crc32 {crc:08x} != {entry.checksums[expert]:08x}"
    return None
