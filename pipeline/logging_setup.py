"""structlog set-up: event names with key-value pairs, to stderr, console or JSON.

Exceptions logged with `exc_info=` show as their type name only, unless the level is
debug (then a plain traceback, never with the frames' local variables: they held the
request's prompt). The processors are qpack.log_default's, shared with the library's
default set-up.
"""

from __future__ import annotations

import logging

import structlog

from qpack.log_default import safe_processors, stderr_logger

_debug = False  # what the last configure_logging chose: failures then print a traceback


def debug_enabled() -> bool:
    return _debug


def configure_logging(level: str = "warning", json: bool = False) -> None:
    global _debug
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise SystemExit(f"--log-level: unknown level {level!r}")
    _debug = numeric <= logging.DEBUG
    structlog.configure(
        processors=safe_processors(debug=numeric <= logging.DEBUG, json=json),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # sys.stderr as it is when a logger is made, not now: a caller that swaps it later
        # (a test's capture, a daemon's redirect) must not leave logs writing to a dead file.
        logger_factory=stderr_logger,
        cache_logger_on_first_use=False,
    )
