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

import structlog
import trio

from pipeline.config.schema import PipelineConfig
from pipeline.engine import open_engine
from pipeline.server.app import serve_engine

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


def _stopping_already(signum: int, _frame: object) -> None:
    log.info("server.shutdown_repeated", signal=signal.Signals(signum).name)


async def _wait_for_signal() -> None:
    # Installed first, so the receiver puts it back when it closes: no moment without it.
    signal.signal(signal.SIGTERM, _stopping_already)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("server.shutdown", signal=signal.Signals(signum).name)
            return


async def serve_config(cfg: PipelineConfig, *, hide_reasoning: bool = False,
                       accepted: tuple[str, ...] = ()) -> int:
    server = cfg.server
    check_bindable(server.host, server.port)
    if not is_loopback(server.host) and server.api_key is None:
        log.warning("server.open_without_key", host=server.host,
                    hint="anyone who can reach this host can use the model; pass --api-key")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        async with open_engine(cfg) as engine:
            await serve_engine(
                engine, server.host, server.port, api_key=server.api_key,
                max_queue=server.max_queue, max_body_bytes=server.max_body_bytes,
                max_tokens_limit=server.max_tokens_limit,
                hide_reasoning=hide_reasoning, aliases=server.aliases, accepted=accepted,
                strict_model=server.strict_model, cors_origins=server.cors_origins,
                shutdown_trigger=_wait_for_signal, shutdown_grace_s=server.shutdown_grace_s,
            )
    finally:
        signal.signal(signal.SIGTERM, previous)  # the server is gone: SIGTERM as before
    log.info("server.stopped")
    return 0
