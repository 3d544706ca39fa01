"""Wait for a message from the left neighbour without spinning a core.

MLX's ring backend (0.32) hands a receive to a per-socket thread that polls its
non-blocking socket until the bytes arrive: a rank waiting for work, or rank 0 waiting
for logits while the later ranks compute, keeps a core busy for as long as it waits (on
a small machine, the core the other ranks compute on). So before asking MLX to receive,
the link thread waits in `select` on that socket until it is readable, which costs
nothing; MLX then receives bytes that are already there. The data still moves through
mlx.distributed; only the wait is ours.

Every receive of the pipeline comes from the left neighbour (rank r-1, and for rank 0 the
last rank), which the ring reaches over the sockets it accepted on this rank's own
address from the hostfile. Those are found by their local port. Where they cannot be
found (another backend, an unusual platform), receives simply spin as before.

Those sockets also get TCP keepalive (`KEEPALIVE`): a neighbour whose machine is lost
(powered off, unplugged) sends nothing, not even a reset, and a later rank waiting for
work would wait on it forever; the probes fail the idle connection within about 25 s,
and the receive then fails as for a closed socket (`RankLost`, one `error:` line).
"""

from __future__ import annotations

import json
import os
import select
import socket
import stat
from pathlib import Path

import structlog

log = structlog.get_logger("moestream.distributed")

# Idle seconds before the first probe, seconds between probes, probes unanswered.
KEEPALIVE = (10, 5, 3)


class Doorbell:
    def __init__(self, sockets: list[socket.socket]) -> None:
        self._sockets = sockets

    @classmethod
    def for_rank(cls, rank: int) -> Doorbell:
        ports = _own_ports(rank)
        found = []
        for s in _sockets():
            if ports and _local_port(s) in ports:
                keep_alive(s)
                found.append(s)
            else:
                s.close()
        if not found:
            log.info("distributed.doorbell_unavailable", rank=rank)
        return cls(found)

    def wait(self, timeout: float | None = None) -> bool:
        """Until a message is there (or the peer closed); False after `timeout` seconds."""
        if not self._sockets:
            return True
        ready, _, broken = select.select(self._sockets, [], self._sockets, timeout)
        return bool(ready or broken)

    def close(self) -> None:
        for s in self._sockets:
            s.close()  # our duplicates only: MLX keeps its own descriptors
        self._sockets = []


def keep_alive(s: socket.socket) -> None:
    """Keepalive on `s` (a duplicate: the options are the socket's, so MLX's too)."""
    idle, interval, count = KEEPALIVE
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # macOS names the idle time TCP_KEEPALIVE.
    idle_option = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))
    for option, value in ((idle_option, idle), (getattr(socket, "TCP_KEEPINTVL", None), interval),
                          (getattr(socket, "TCP_KEEPCNT", None), count)):
        if option is not None:
            try:
                s.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:  # an option this platform refuses: its default stays
                pass


def _own_ports(rank: int) -> set[int]:
    """This rank's listening ports, from the ring hostfile mlx.launch wrote."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        hosts = json.loads(Path(path).read_text()) if path else None
        return {int(str(a).rsplit(":", 1)[1]) for a in hosts[rank]} if hosts else set()
    except (OSError, ValueError, IndexError, TypeError):
        return set()


def _descriptors() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no procfs (macOS): the low descriptors, where sockets opened at init are
        return list(range(3, 256))


def _sockets() -> list[socket.socket]:
    out = []
    for fd in _descriptors():
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
            out.append(s)
        else:
            s.close()
    return out


def _local_port(s: socket.socket) -> int | None:
    try:
        s.getpeername()  # connected, not a listening socket
        return int(s.getsockname()[1])
    except OSError:
        return None
