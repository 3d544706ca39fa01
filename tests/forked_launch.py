"""`moestream launch -n N -- moestream ARGV` as the tests run it: a real launcher process.

The launcher is forked from the test session's fork server, and it forks its ranks
(`fork_spawn`) instead of exec'ing `moestream` (seconds of imports per rank): each rank
is still a child process of the launcher with its own pid, signals and exit status, and
the launcher's own code (`pipeline.distributed.launch`) forwards, reaps and kills.
Everything the job prints (the launcher's and the ranks' lines) arrives in one pipe.
"""

from __future__ import annotations

import io
import os
import queue
import re
import signal
import sys
import time
from multiprocessing import connection
from multiprocessing.context import BaseContext
from pathlib import Path

from forked_ranks import LineLog

PRELOAD = ["forked_launch", "pipeline.distributed.launch"]


def fork_spawn(command: list[str], env: dict[str, str]) -> int:
    """`exec_spawn`'s stand-in: `command` is `["moestream", *argv]`, run in a fork."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGINT):  # what an exec would have reset
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM
                          else signal.default_int_handler)
        from pipeline.cli import main

        status = main(command[1:])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return pid


def _launcher(w: connection.Connection, size: int, argv: list[str], kill_after_s: float) -> None:
    os.dup2(w.fileno(), 1)
    os.dup2(w.fileno(), 2)
    w.close()
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    from pipeline.distributed.launch import launch
    from pipeline.logging_setup import configure_logging

    configure_logging("info")
    sys.exit(launch(size, ["moestream", *argv], kill_after_s, spawn=fork_spawn))


def alive(pid: int) -> bool:
    """Running (a zombie has exited: only its exit status waits to be collected)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Launched(LineLog):
    """A launcher of `size` ranks of `moestream ARGV`; `pids` once they started."""

    def __init__(self, ctx: BaseContext, size: int, argv: list[str],
                 kill_after_s: float = 30.0) -> None:
        r, w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_launcher, args=(w, size, argv, kill_after_s))
        self.proc.start()
        w.close()
        self._follow(r)
        started = self.wait_for("launch.started", 60)
        self.ranks = [int(p) for p in re.search(r"pids=\[([\d, ]+)\]", started)[1].split(",")]


    def wait_for(self, text: str, timeout: float) -> str:
        """The first line with `text`, of those already seen too."""
        for line in self.log:
            if text in line:
                return line
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            self.log.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout} s:\n{self.output()[-4000:]}\n{self.threads()}")

    def threads(self) -> str:
        """The launcher's threads: name, state, where each waits, its signal masks."""
        out = []
        for pid in [self.proc.pid, *getattr(self, "ranks", [])]:
            for tid in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else []:
                base = f"/proc/{pid}/task/{tid}"
                try:
                    status = Path(f"{base}/status").read_text().splitlines()
                    wchan = Path(f"{base}/wchan").read_text()
                except OSError:
                    continue
                keep = [line for line in status if line.startswith(("Name", "State", "Sig", "ShdPnd"))]
                out.append(f"{pid}/{tid} wchan={wchan} " + " | ".join(keep))
        return "\n".join(out)

    def pids(self) -> list[int]:
        return [self.proc.pid, *self.ranks]

    def gone_within(self, timeout: float) -> bool:
        """Whether the launcher and every rank have exited within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while any(alive(pid) for pid in self.pids()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        self.proc.join(1)
        return True

    def kill(self) -> None:
        for pid in self.pids():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.join(10)
