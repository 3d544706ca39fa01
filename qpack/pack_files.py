"""The packer's file writing: every output as `<name>.partial`, fsynced, then renamed
(`_Out`), positional writes, disk-full errors as one line, and the milestones a test
can stop a pack at (qpack/writer.py uses them all)."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec

from qpack.milestones import milestone as _milestone
from qpack.spec import QpackError


class Done(msgspec.Struct):
    size: int
    sha256: str
    checksums: list[int] = []


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Out:
    """One output file written as .partial then renamed; hashes while writing."""

    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        self.path = root / rel
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.sha = hashlib.sha256()
        self.size = 0
        self.f: BinaryIO  # opened by __enter__

    def __enter__(self) -> _Out:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = _guard(self.partial, lambda: open(self.partial, "wb"))  # noqa: SIM115
        _milestone(f"begin {self.rel}")
        return self

    def write(self, data: bytes | bytearray | memoryview) -> None:
        _guard(self.partial, lambda: self.f.write(data))
        self.sha.update(data)
        self.size += len(data)

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is not None:
            self.f.close()
            if isinstance(exc, QpackError):  # disk full: free the space of what we wrote
                self.partial.unlink(missing_ok=True)
            return
        def finish() -> None:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.partial, self.path)
            _fsync_dir(self.path.parent)
        _guard(self.partial, finish)
        _milestone(f"renamed {self.rel}")

    def done(self) -> Done:
        return Done(self.size, self.sha.hexdigest())


def _pwrite(fd: int, data: bytes | memoryview, offset: int, path: Path) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = _guard(path, lambda v=view, o=offset: os.pwrite(fd, v, o))
        view, offset = view[n:], offset + n


def _guard(path: Path, fn: Callable):  # noqa: ANN202
    try:
        return fn()
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QpackError(path, "disk full (ENOSPC) while writing; free space and re-run pack to resume") from None
        raise


