"""`moestream ARGV` as a process of its own, forked from the shared fork server.

A fresh interpreter spends seconds importing MLX, mlx-lm and the engine before `serve`
can listen; a fork of the server that preloaded them starts at once. The child is still
a process of its own: its own signals, its own exit status, stdout and stderr in a pipe.
"""

from __future__ import annotations

import io
import os
import sys
from multiprocessing import connection
from multiprocessing.context import BaseContext

from pipeline.cli import main

PRELOAD = ["pipeline.cli", "pipeline.cli.serve", "pipeline.server.serve", "forked_cli"]


def _child(w: connection.Connection, argv: list[str]) -> None:
    os.dup2(w.fileno(), 1)
    os.dup2(w.fileno(), 2)
    w.close()
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    sys.exit(main(argv))


class ForkedCLI:
    """Like `subprocess.Popen([moestream, *argv], stdout=PIPE, stderr=STDOUT, text=True)`:
    `pid`, `stdout` (lines), `poll()`, `wait(timeout)`, `send_signal(sig)`, `kill()`."""

    def __init__(self, ctx: BaseContext, argv: list[str]) -> None:
        r, w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(w, argv))
        self._proc.start()
        w.close()
        self.pid = self._proc.pid
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

