"""The ranks of a distributed job on localhost, as `mlx.launch --backend ring` starts them.

`mlx.launch` writes a hostfile (one `127.0.0.1:port` per rank), sets MLX_HOSTFILE and
MLX_RANK, and runs the same command once per rank. These ranks are forked from the test
session's fork server instead (engine preloaded: no seconds of imports per rank), each a
process of its own with its own exit status and output; they can be killed one by one,
which the fault test needs, and which `mlx.launch` would answer by terminating the rest.
"""

from __future__ import annotations

import io
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from pipeline.distributed.launch import free_ports

PRELOAD = ["forked_ranks", "distributed_ranks", "pipeline.distributed.job", "pipeline.distributed.worker"]


def _child(w: connection.Connection, rank: int, hostfile: str,
           target: Callable[..., int], args: tuple[Any, ...]) -> None:
    os.dup2(w.fileno(), 1)
    os.dup2(w.fileno(), 2)
    w.close()
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = hostfile
    sys.exit(target(*args))


def cli(argv: list[str]) -> int:
    from pipeline.cli import main

    return main(argv)


class LineLog:
    """A child's output, read by a thread into a queue; what was seen so far kept."""

    lines: queue.Queue[str]
    log: list[str]

    def _follow(self, r: connection.Connection) -> None:
        """Read the child's end of the pipe `r` (this side's copy is closed) in a thread."""
        self.lines = queue.Queue()
        self.log = []
        out = io.TextIOWrapper(os.fdopen(os.dup(r.fileno()), "rb"))
        r.close()
        threading.Thread(target=self._pump, args=(out,), daemon=True).start()

    def _pump(self, out: io.TextIOWrapper) -> None:
        for line in out:
            self.lines.put(line)

    def output(self) -> str:
        while True:
            try:
                self.log.append(self.lines.get_nowait())
            except queue.Empty:
                return "".join(self.log)


class Rank(LineLog):
    def __init__(self, ctx: BaseContext, rank: int, hostfile: str,
                 target: Callable[..., int], args: tuple[Any, ...]) -> None:
        r, w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child, args=(w, rank, hostfile, target, args))
        self.proc.start()
        w.close()
        self._follow(r)


    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.exitcode is not None:
                    break
                continue
            self.log.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout} s:\n{self.output()[-4000:]}")

    def wait(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode


class Job:
    """`size` ranks running `target(*args)` (default: the CLI with `args` as argv)."""

    def __init__(self, ctx: BaseContext, size: int, tmp: Path, args: tuple[Any, ...],
                 target: Callable[..., int] = cli) -> None:
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(size)]))
        self.ranks = [Rank(ctx, r, str(hostfile), target, args) for r in range(size)]

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        return [r.wait(max(0.1, deadline - time.monotonic())) for r in self.ranks]

    def kill(self) -> None:
        for r in self.ranks:
            if r.proc.exitcode is None:
                r.proc.kill()
        for r in self.ranks:
            r.proc.join(10)

    def outputs(self) -> str:
        return "\n".join(f"--- rank {i}\n{r.output()[-3000:]}" for i, r in enumerate(self.ranks))
