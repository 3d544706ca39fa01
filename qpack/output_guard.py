"""Guards for commands that write big outputs: one writer per directory, room on the disk.

Two `pack`s into one directory would interleave their `.partial` files and journals;
a write that cannot fit fails hours in with a full disk. Both are refused up front.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from qpack.spec import QpackError

# Room kept free beyond the estimate: file-system metadata, the journal, the manifest.
SPACE_MARGIN_BYTES = 64 * 2**20


class DiskSpaceError(QpackError):
    """Not enough free space for what a command is about to write."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 2**20:.1f} MiB"


def _existing(path: Path) -> Path:
    """The nearest existing ancestor: where the output's file system is."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def bytes_under(path: Path, pattern: str = "**/*") -> int:
    """Bytes already written under `path` (they count towards a resumed write)."""
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file() and not p.is_symlink())


def require_free_space(out: Path, need_bytes: int, what: str, *, already: int = 0) -> None:
    """Refuse to start writing `need_bytes` into `out` (less `already` written there)."""
    left = max(0, need_bytes - already)
    free = shutil.disk_usage(_existing(out)).free
    if left + SPACE_MARGIN_BYTES > free:
        more = f" ({_gb(already)} of it already written, {_gb(left)} to go)" if already else ""
        raise DiskSpaceError(out, f"{what} needs {_gb(need_bytes)}{more}, but only {_gb(free)} is free "
                             "on that disk; free space or write elsewhere")


@contextmanager
def exclusive_output(out: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on the output directory while writing it (flock: the kernel
    drops it when the process dies, so a killed writer never leaves a stale lock).
    A directory made here and still empty at the end (the job was refused before writing
    anything) is removed again."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise QpackError(out, f"another {what} is writing this directory right now; "
                                 "wait for it or choose another output") from None
            raise
        yield
    finally:
        os.close(fd)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


class OutputPathError(QpackError):
    """An output file that cannot be written where it is named; found before any work."""


def check_output_file(path: str | os.PathLike[str], what: str,
                      made: Collection[Path] = ()) -> Path:
    """Refuse, before the work that produces it, an output file that cannot be written:
    a directory in its place, a missing or unwritable directory. Nothing is created here
    (a missing directory is the user's typo, not ours to make), except that `made` names
    directories the work itself creates before it writes the file (the container's own
    directory, packed on a first run): there the nearest existing one must be writable."""
    out = Path(path)
    if out.is_dir():
        raise OutputPathError(out, f"{what} is a directory, not a file")
    parent = out.absolute().parent
    if not parent.is_dir() and parent in made:
        parent = next(p for p in parent.parents if p.is_dir())
    if not parent.is_dir():
        raise OutputPathError(out, f"{what}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise OutputPathError(out, f"{what}: not writable")
    return out


def write_file_atomically(path: str | os.PathLike[str], data: bytes) -> Path:
    """`data` under `path`, whole or not at all: a hidden temporary beside it, renamed
    over it; on any failure the temporary is removed (nothing is left but the output)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


@contextmanager
def removed_on_failure(out: Path) -> Iterator[None]:
    """A directory this job fills from nothing is removed again if the job fails (an
    error, Ctrl-C): a re-run then finds no half-written output that it must refuse. A
    directory that held something before is left alone (resumable writers handle it)."""
    fresh = not out.exists() or (out.is_dir() and not any(out.iterdir()))
    try:
        yield
    except BaseException:
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise
