"""Library logs go to stderr unless the application configured structlog itself.

structlog's own default prints to stdout, where a program streaming generated text
would get log lines glued into it. The `moestream` CLI configures logging explicitly;
this only sets the destination for programs that import the packages and never do.
"""

from __future__ import annotations

import sys
from typing import Any

import structlog


def stderr_logger(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)  # looked up per logger: follows redirections


def log_to_stderr_by_default() -> None:
    if not structlog.is_configured():
        structlog.configure(logger_factory=stderr_logger)
