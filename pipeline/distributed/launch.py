"""`moestream launch -n N -- COMMAND`: a job's ranks on this machine, stoppable by its PID.

What a service manager starts: systemd, Docker, Kubernetes and plain `kill` stop a job
through the PID they started, so this process forwards SIGTERM and SIGINT to its ranks
and waits for them, and exits with their status. It does for local ranks what
`mlx.launch -n N --backend ring` does (a ring hostfile on free loopback ports,
MLX_HOSTFILE and MLX_RANK per rank, the same command for every rank), without its output
pump (a thread per rank that spins a core) and without its stop paths that only run when
it exits of its own accord. The ranks write straight to this process's stdout and stderr
(a journal or a log driver gets their lines as they are). Should this process die anyway
(SIGKILL), each rank finds it gone through `MOESTREAM_LAUNCHER_PID` (launcher_watch.py).

A rank that fails makes the others stop (SIGTERM; they would find it lost anyway), and
what is left of a stopping job (SIGTERM, or a failed rank) `kill_after_s` later is
killed; SIGINT is only passed on (a `chat` stops its reply and goes on, a server stops).
Exit status: that of the first rank to fail (128 + N for a signal N), else 0. The
launcher reaps whichever child exits (`os.wait`): it runs in a process of its own (the
CLI), whose children are its ranks.

Imports nothing heavy: the launcher never loads MLX.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import structlog

from pipeline.distributed.launcher_watch import HOSTFILE_PREFIX, LAUNCHER_ENV

log = structlog.get_logger("moestream.launch")

FORWARDED = (signal.SIGTERM, signal.SIGINT)
# How often the main thread looks for a rank that exited (`LocalJob._reap`).
REAP_POLL_S = 0.05

# How a rank process is made from the command and its environment: its pid, a child of
# this process that `LocalJob.wait` reaps. Tests fork from a process that preloaded the
# engine instead (the rank then starts at once; everything else is the same).
Spawn = Callable[[list[str], dict[str, str]], int]


def exec_spawn(command: list[str], env: dict[str, str]) -> int:
    # posix_spawn, not subprocess.Popen: Popen objects reap their own children at times,
    # and this process reaps every rank itself (`os.wait`).
    return os.posix_spawnp(command[0], command, env)


class LaunchError(ValueError):
    """The ranks could not be started (the command is not there, not executable)."""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _exit_status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


def _terminal_delivered() -> bool:
    """Whether this process is in its terminal's foreground group: a Ctrl-C there has
    reached every rank already (they share this group), so forwarding would double it."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def _deaf_thread(target: Callable[[], None], name: str,
                 after_s: float | None = None) -> threading.Timer:
    """A daemon thread (`after_s` later) that never takes the forwarded signals: the
    kernel may hand a process's signal to any thread that does not block it, and one
    taken by a helper leaves the main thread asleep in `os.wait` until a rank exits."""
    thread = threading.Timer(after_s or 0.0, target)
    thread.name, thread.daemon = name, True
    old = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        thread.start()  # a new thread starts with its creator's signal mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread


class LocalJob:
    """`size` ranks of `command` on this machine (`start` starts them all at once)."""

    def __init__(self, size: int, command: list[str], kill_after_s: float,
                 spawn: Spawn = exec_spawn) -> None:
        self.size, self.command, self.kill_after_s = size, command, kill_after_s
        self.spawn = spawn
        self.status: int | None = None  # the first failure's exit status
        self.stopping = False
        self._killer: threading.Timer | None = None
        self._stop_notes: queue.SimpleQueue[signal.Signals] = queue.SimpleQueue()
        _deaf_thread(self._stops, "moestream-launch-stops")
        self.live: dict[int, int] = {}  # pid -> rank, until reaped
        self.hostfile: Path | None = None

    def start(self) -> None:
        if self.stopping:  # told to stop (SIGTERM) before anything started
            return
        fd, name = tempfile.mkstemp(prefix=HOSTFILE_PREFIX, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{port}"] for port in free_ports(self.size)], f)
        self.hostfile = Path(name)
        base = {**os.environ, "MLX_HOSTFILE": name, LAUNCHER_ENV: str(os.getpid())}
        for rank in range(self.size):
            if self.stopping:  # SIGTERM while starting: the ranks started so far got it
                break
            try:
                self.live[self.spawn(self.command, {**base, "MLX_RANK": str(rank)})] = rank
            except OSError as exc:  # the job cannot start: the ranks begun so far go
                self._signal_all(signal.SIGKILL)
                for pid in list(self.live):
                    os.waitpid(pid, 0)
                self.live.clear()
                raise LaunchError(f"cannot start rank {rank}: {self.command[0]}: "
                                  f"{exc.strerror or exc}") from None
        log.info("launch.started", ranks=self.size, pids=list(self.live), hostfile=name)

    def forward(self, signum: int, _frame: FrameType | None = None) -> None:
        """A signal for the job: every rank gets it (a SIGINT from the terminal has).

        A signal handler runs between any two bytecodes of the main thread, which may be
        writing a log line: it only sends signals and hands the rest to `_stops` through
        a SimpleQueue (whose put is safe there)."""
        sig = signal.Signals(signum)
        self.stopping = self.stopping or sig == signal.SIGTERM
        if not (sig == signal.SIGINT and _terminal_delivered()):
            self._signal_all(sig)
        self._stop_notes.put(sig)

    def _stops(self) -> None:
        while True:
            sig = self._stop_notes.get()
            log.info("launch.signal", signal=sig.name, ranks=len(self.live))
            if sig == signal.SIGTERM:  # SIGINT is the ranks' to judge (a chat stops its reply)
                self._arm_killer()

    def _signal_all(self, sig: signal.Signals) -> None:
        for pid in list(self.live):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # exited, not yet reaped
                pass

    def _arm_killer(self) -> None:
        if self._killer is None:
            self._killer = _deaf_thread(self._kill_rest, "moestream-launch-kill",
                                        self.kill_after_s)

    def _kill_rest(self) -> None:
        if self.live:
            log.warning("launch.kill", ranks=sorted(list(self.live.values())),
                        after_s=self.kill_after_s)
            self._signal_all(signal.SIGKILL)

    def wait(self) -> int:
        """Until every rank has exited; the job's exit status."""
        try:
            while self.live:
                pid, wait_status = self._reap()  # a forwarded signal's handler runs meanwhile
                rank = self.live.pop(pid, None)
                if rank is None:
                    continue
                status = _exit_status(wait_status)
                if status == 0:
                    log.info("launch.rank_done", rank=rank)
                    continue
                log.warning("launch.rank_failed", rank=rank, status=status)
                if self.status is None:
                    self.status = status
                    self._signal_all(signal.SIGTERM)  # the job cannot go on without it
                    self._arm_killer()
        finally:
            if self._killer is not None:
                self._killer.cancel()
        return self.status or 0

    @staticmethod
    def _reap() -> tuple[int, int]:
        """The next rank that exits: its pid and wait status. Polled rather than a blocking
        `os.wait()`: a signal that arrives while this thread runs the last one's handler
        only sets Python's flag, and `os.wait()` is entered again (PEP 475) without looking
        at it, so a second SIGTERM waited until a rank exited (4 of 40 runs of
        `test_sigterm_to_the_launcher_is_forwarded_and_waited_for` beside two busy loops:
        no rank got it, nothing pending in the kernel). Here it runs within `REAP_POLL_S`."""
        while True:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid:
                return pid, wait_status
            time.sleep(REAP_POLL_S)

    def close(self) -> None:
        if self.hostfile is not None:
            self.hostfile.unlink(missing_ok=True)


def launch(size: int, command: list[str], kill_after_s: float, spawn: Spawn = exec_spawn) -> int:
    job = LocalJob(size, command, kill_after_s, spawn)
    # Before the ranks start: a stop in between reaches them too.
    previous = {sig: signal.signal(sig, job.forward) for sig in FORWARDED}
    try:
        job.start()
        return job.wait()
    finally:
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout.flush()
