"""Serve an engine until SIGINT/SIGTERM.

The engine is opened once for the server's life; a signal starts hypercorn's graceful
shutdown (in-flight requests get `graceful_timeout` to finish, then are cancelled),
then the engine closes.
"""

from __future__ import annotations

import ipaddress
import signal

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


async def _wait_for_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("server.shutdown", signal=signal.Signals(signum).name)
            return


async def serve_config(cfg: PipelineConfig, *, hide_reasoning: bool = False,
                       accepted: tuple[str, ...] = ()) -> int:
    server = cfg.server
    if not is_loopback(server.host) and server.api_key is None:
        log.warning("server.open_without_key", host=server.host,
                    hint="anyone who can reach this host can use the model; pass --api-key")
    async with open_engine(cfg) as engine:
        await serve_engine(
            engine, server.host, server.port, api_key=server.api_key,
            max_queue=server.max_queue, max_body_bytes=server.max_body_bytes,
            hide_reasoning=hide_reasoning, aliases=server.aliases, accepted=accepted,
            strict_model=server.strict_model, cors_origins=server.cors_origins,
            defaults=cfg.sampling,
            shutdown_trigger=_wait_for_signal,
        )
    log.info("server.stopped")
    return 0
