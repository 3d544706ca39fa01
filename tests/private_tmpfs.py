"""A tmpfs of a chosen size that only this process sees: a real ENOSPC without root.

`unshare(CLONE_NEWUSER | CLONE_NEWNS)` makes the calling process root of its own user
namespace with its own mount table (what `unshare -rm` does), where mounting a tmpfs is
allowed and invisible to everyone else. Call it in a child process that has one thread
(a fork server's child): the kernel refuses a new user namespace to a threaded process,
and the mount would outlive the caller's test otherwise.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REMOUNT = 32
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_private_namespace() -> None:
    """Become root of a new user namespace with a private copy of the mount table."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    Path("/proc/self/setgroups").write_text("deny")  # required before an unprivileged gid_map
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    # No mount or unmount of ours propagates to the namespace we came from.
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def mount_tmpfs(path: Path, size: str, *, remount: bool = False) -> None:
    """Mount (or resize, keeping its files) a tmpfs of `size` ("3m") at `path`."""
    flags = MS_REMOUNT if remount else 0
    _check(_libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", flags, f"size={size}".encode()),
           f"mount tmpfs {path}")
