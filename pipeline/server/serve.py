"""Serve an engine until SIGINT/SIGTERM.

The engine is opened once for the server's life; a signal starts hypercorn's graceful
shutdown (in-flight requests get `server.shutdown_grace_s` to finish, then are cancelled),
then the engine closes. A SIGTERM after the first is absorbed: a service manager that
signals every process of a job and the launcher that forwards the signal both send one,
and the second must not cut the drain short (SIGINT again, or SIGKILL, still do).
"""

from __future__ import annotations

import errno
import ipaddress
import signal
import socket
from typing import TYPE_CHECKING

import structlog
import trio

from pipeline.config.schema import PipelineConfig
from pipeline.engine import open_engine
from pipeline.server.app import serve_engine
from pipeline.server.settings import ServerSettings

if TYPE_CHECKING:
    from pipeline.distributed.stage import Stage

log = structlog.get_logger("moestream.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class PortInUse(OSError):
    """The server's address cannot be bound; found before the model is loaded."""


def check_bindable(host: str, port: int) -> None:
    """Bind and release (host, port) as hypercorn will, so a busy port fails in a second
    instead of after loading the model."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn does
        try:
            sock.bind(address)
        except OSError as exc:
            hint = "; another server is using it: choose another --port" if exc.errno == errno.EADDRINUSE else ""
            raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None


async def _watch_signals(stop: trio.Event) -> None:
    """The first SIGINT or SIGTERM stops the server; a repeated SIGTERM is absorbed, a
    repeated SIGINT (a second Ctrl-C) stops the process at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not stop.is_set():
                log.info("server.shutdown", signal=name)
                stop.set()
            elif signum == signal.SIGTERM:
                log.info("server.shutdown_repeated", signal=name)
            else:
                raise KeyboardInterrupt


async def serve_config(cfg: PipelineConfig, *, hide_reasoning: bool = False,
                       accepted: tuple[str, ...] = (), stage: Stage | None = None) -> int:
    server = cfg.server
    check_bindable(server.host, server.port)
    if not is_loopback(server.host) and server.api_key is None:
        log.warning("server.open_without_key", host=server.host,
                    hint="anyone who can reach this host can use the model; pass --api-key")
    async with open_engine(cfg, stage=stage) as engine, trio.open_nursery() as nursery:
        stop = trio.Event()
        nursery.start_soon(_watch_signals, stop)
        settings = ServerSettings.of(server, hide_reasoning=hide_reasoning, accepted=accepted)
        await serve_engine(engine, settings, shutdown_trigger=stop.wait)
        nursery.cancel_scope.cancel()
    log.info("server.stopped")
    return 0
