"""structlog set-up: event names with key-value pairs, to stderr, console or JSON."""

from __future__ import annotations

import logging
import sys

import structlog

from qpack.log_default import stderr_logger


def configure_logging(level: str = "warning", json: bool = False) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise SystemExit(f"--log-level: unknown level {level!r}")
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # sys.stderr as it is when a logger is made, not now: a caller that swaps it later
        # (a test's capture, a daemon's redirect) must not leave logs writing to a dead file.
        logger_factory=stderr_logger,
        cache_logger_on_first_use=False,
    )
