"""Library logs go to stderr unless the application configured structlog itself.

structlog's own default prints to stdout, where a program streaming generated text
would get log lines glued into it, prints debug lines, and renders an exception with
rich's traceback and every frame's local variables: a failed request's prompt ("my
credit card is ...") went into the log. The `moestream` CLI configures logging
explicitly (pipeline.logging_setup); this sets the same safe defaults for programs
that import the packages and never do: stderr, info and above, no locals.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


def stderr_logger(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)  # looked up per logger: follows redirections


def exceptions(debug: bool) -> structlog.typing.Processor:
    """A processor for `exc_info=`: below debug, only the exception's type name (its
    message and traceback can hold request text); at debug, a plain traceback (never
    the frames' local variables)."""

    def process(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        exc = event.pop("exc_info", None)
        if exc is None or exc is False:
            return event
        if exc is True:
            exc = sys.exc_info()[1]
        elif isinstance(exc, tuple):
            exc = exc[1]
        if isinstance(exc, BaseException):
            event["error_type"] = type(exc).__name__
            if debug:
                event["exc_info"] = exc
        return event

    return process


def safe_processors(debug: bool, json: bool = False) -> list[structlog.typing.Processor]:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                           exception_formatter=structlog.dev.plain_traceback))
    steps: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
        exceptions(debug)]
    if json:  # JSON gets the traceback as a string: dict_tracebacks would add the locals
        steps.append(structlog.processors.format_exc_info)
    return [*steps, renderer]


def log_to_stderr_by_default() -> None:
    if not structlog.is_configured():
        structlog.configure(
            processors=safe_processors(debug=False),
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_factory=stderr_logger,
            cache_logger_on_first_use=False,
        )
