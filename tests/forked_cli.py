"""`moestream ARGV` as a process of its own, forked from the shared fork server.

A fresh interpreter spends seconds importing MLX, mlx-lm and the engine before `serve`
can listen; a fork of the server that preloaded them starts at once. The child is still
a process of its own: its own signals, its own exit status, stdout and stderr in a pipe.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
from multiprocessing import connection
from multiprocessing.context import BaseContext

from pipeline.cli import main

PRELOAD = ["pipeline.cli", "pipeline.cli.serve", "pipeline.server.serve", "forked_cli"]


_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2
_CAP_VERSION_3 = 0x20080522


def honour_file_permissions() -> None:
    """Drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this process (Linux), so that
    even root is refused a file it has no permission bits for (`chmod 000`); a no-op for
    a user who never had them. Threads started afterwards inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    keep = ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH)) & 0xFFFFFFFF
    for i in (0, 1):  # effective and permitted of the low word
        data[i] &= keep
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _child(w: connection.Connection, argv: list[str], err: connection.Connection | None,
           stdin: connection.Connection | None, permissions: bool = False) -> None:
    if permissions:
        honour_file_permissions()
    os.dup2(w.fileno(), 1)
    os.dup2((err or w).fileno(), 2)
    for c in (w, err):
        if c is not None:
            c.close()
    if stdin is not None:  # multiprocessing gave the child /dev/null
        os.dup2(stdin.fileno(), 0)
        stdin.close()
        sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", buffering=0))
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    sys.exit(main(argv))


class ForkedCLI:
    """Like `subprocess.Popen([moestream, *argv], stdout=PIPE, stderr=STDOUT, text=True)`:
    `pid`, `stdout` (lines), `poll()`, `wait(timeout)`, `send_signal(sig)`, `kill()`.
    With `pipes=True`, like `stdin=PIPE, stdout=PIPE, stderr=PIPE` instead: `stdin`,
    `stdout` and `stderr` are binary, unbuffered. With `permissions`, file permissions
    bind the child even when the tests run as root (`honour_file_permissions`)."""

    def __init__(self, ctx: BaseContext, argv: list[str], pipes: bool = False,
                 permissions: bool = False) -> None:
        r, w = ctx.Pipe(duplex=False)
        r_err, w_err = ctx.Pipe(duplex=False) if pipes else (None, None)
        r_in, w_in = ctx.Pipe(duplex=False) if pipes else (None, None)
        self._proc = ctx.Process(target=_child, args=(w, argv, w_err, r_in, permissions))
        self._proc.start()
        for c in (w, w_err, r_in):
            if c is not None:
                c.close()
        self.pid = self._proc.pid
        if pipes:
            assert r_err is not None and w_in is not None
            self.stdout = os.fdopen(os.dup(r.fileno()), "rb", buffering=0)
            self.stderr = os.fdopen(os.dup(r_err.fileno()), "rb", buffering=0)
            self.stdin = os.fdopen(os.dup(w_in.fileno()), "wb", buffering=0)
            r_err.close()
            w_in.close()
        else:
            self.stdout = io.TextIOWrapper(os.fdopen(os.dup(r.fileno()), "rb"))
        r.close()

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"moestream (pid {self.pid}) still running after {timeout} s")
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()

