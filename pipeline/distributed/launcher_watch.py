"""A rank stops when its launcher goes away, however it goes.

`mlx.launch` ends its ranks only on its own exit paths: killed by SIGKILL, by Python's
default SIGTERM or by a crash, it leaves them running with parent PID 1, holding their
memory and the server's port, and a client keeps talking to the orphan. So every rank
watches the process that started it and, once it is gone, sends itself SIGTERM: rank 0
then stops as on any SIGTERM (a server drains), the later ranks leave the stop to rank 0
(`job.py`). The watch is a daemon thread blocked on the kernel's word that the launcher
exited (`WATCHES`: a pidfd on Linux, kqueue's NOTE_EXIT on macOS and the BSDs, else a
look at the parent every half second), so it costs nothing while the launcher lives.

Which process is the launcher: `MOESTREAM_LAUNCHER_PID` where `moestream launch` started
this rank, else this process's parent as it was at start (the CLI imports this module
first thing: read later, a launcher that died meanwhile would already show as PID 1).

This module imports nothing heavy: the CLI imports it before it parses its arguments.
"""

from __future__ import annotations

import os
import select
import signal
import stat
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("moestream.distributed")

LAUNCHER_ENV = "MOESTREAM_LAUNCHER_PID"
HOSTFILE_PREFIX = "moestream-hosts-"  # the ring hostfile `moestream launch` writes
POLL_S = 0.5  # the fallback watch: how often it looks at the parent
ORPHAN_CHECK_S = 0.5  # how long a pipe of ours may keep a reader once the launcher is gone

_parent_at_start = os.getppid()


def _forked() -> None:
    global _parent_at_start, _armed
    _parent_at_start = os.getppid()  # a forked child's starter is the process that forked it
    _armed = None  # and the watch thread stayed behind in the parent


os.register_at_fork(after_in_child=_forked)


def launcher_pid() -> int:
    """The process whose end ends this rank."""
    text = os.environ.get(LAUNCHER_ENV, "")
    return int(text) if text.isdigit() else _parent_at_start


# A watch arms itself on `pid` at once (ProcessLookupError when it is gone already, so a
# launcher that died before the watch began is not missed) and gives back the blocking
# wait for its end.
Arm = Callable[[int], Callable[[], None]]


def _pidfd(pid: int) -> Callable[[], None]:
    fd = os.pidfd_open(pid)  # Linux >= 5.3

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.close(fd)

    return wait


def _kqueue(pid: int) -> Callable[[], None]:
    # kqueue exists on macOS and the BSDs only; the checker reads Linux's `select`.
    kq = select.kqueue()  # type: ignore[attr-defined]
    event = select.kevent(pid, filter=select.KQ_FILTER_PROC,  # type: ignore[attr-defined]
                          flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT,  # type: ignore[attr-defined]
                          fflags=select.KQ_NOTE_EXIT)  # type: ignore[attr-defined]
    kq.control([event], 0, 0)

    def wait() -> None:
        kq.control(None, 1, None)
        kq.close()

    return wait


def _poll(pid: int) -> Callable[[], None]:
    # The launcher as parent: gone when this process is handed to another (that happens
    # at its exit, before anyone reaps it). Any other pid: gone when it no longer exists.
    parent = os.getppid() == pid

    def gone() -> bool:
        if parent:
            return os.getppid() != pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    if gone():
        raise ProcessLookupError(pid)

    def wait() -> None:
        while not gone():
            time.sleep(POLL_S)

    return wait


WATCHES: dict[str, tuple[Callable[[], bool], Arm]] = {
    "pidfd": (lambda: hasattr(os, "pidfd_open"), _pidfd),
    "kqueue": (lambda: hasattr(select, "kqueue"), _kqueue),
    "poll": (lambda: True, _poll),
}


def available_watches() -> list[str]:
    return [name for name, (usable, _) in WATCHES.items() if usable()]


_armed: str | None = None  # a process watches its launcher once, however many jobs it runs


def watch_launcher(how: str | None = None, pid: int | None = None) -> str:
    """Arm the watch (the first usable of `WATCHES`, or `how`) on the launcher; when it
    is gone this process gets SIGTERM. The name of the watch that was armed."""
    global _armed
    if _armed is None:
        _armed = _arm(how, launcher_pid() if pid is None else pid)
    return _armed


def _arm(how: str | None, pid: int) -> str:
    names = [how] if how is not None else available_watches()
    for name in names:
        try:
            wait = WATCHES[name][1](pid)
        except ProcessLookupError:
            _launcher_gone(pid, name)
            return name
        except OSError:  # not on this kernel (pidfd_open: ENOSYS): the next watch
            continue
        threading.Thread(target=_wait_then_stop, args=(wait, pid, name),
                         name="moestream-launcher-watch", daemon=True).start()
        log.debug("distributed.launcher_watch", launcher=pid, watch=name)
        return name
    raise RuntimeError(f"no way to watch the launcher here (tried {', '.join(names)})")


def _wait_then_stop(wait: Callable[[], None], pid: int, name: str) -> None:
    wait()
    _launcher_gone(pid, name)


def _launcher_gone(pid: int, name: str) -> None:
    _quiet_orphaned_stdio()
    _remove_launchers_hostfile()
    log.warning("distributed.launcher_gone", launcher=pid, watch=name, action="SIGTERM")
    os.kill(os.getpid(), signal.SIGTERM)


def _remove_launchers_hostfile() -> None:
    """A `moestream launch` killed by SIGKILL leaves its hostfile behind: the ranks it
    started remove it (every rank has read it by now, or fails without its launcher)."""
    path = os.environ.get("MLX_HOSTFILE", "")
    if os.environ.get(LAUNCHER_ENV) and os.path.basename(path).startswith(HOSTFILE_PREFIX):
        try:
            os.unlink(path)
        except OSError:  # another rank was first
            pass


def _quiet_orphaned_stdio() -> None:
    """stdout and stderr that were pipes to the launcher (mlx.launch pumps its ranks'
    output) have no reader now: every log line of the drain would fail with EPIPE, and
    the last `error:` line too. Such a pipe is pointed at /dev/null; a file, a terminal,
    a journal socket or a pipe someone still reads stays as it is (after
    `ORPHAN_CHECK_S`: the launcher's last descriptors may close a moment after it ends)."""
    if not hasattr(select, "poll"):
        return
    pipes = []
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                pipes.append(fd)
        except OSError:
            continue
    deadline = time.monotonic() + ORPHAN_CHECK_S
    while pipes:
        for fd in list(pipes):
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            # No reader left: Linux says POLLERR; POLLHUP too, for the BSDs' and macOS's sake.
            if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
                pipes.remove(fd)
        if time.monotonic() > deadline:
            return
        if pipes:
            time.sleep(0.05)
