"""How a command that fails tells the user: one line, `error: <message>`, exit 1.

Errors surface from deep inside trio nurseries wrapped in exception groups, and from
libraries whose messages span lines; a user needs the one cause that matters, on one
line. `--log-level debug` adds the whole traceback for whoever debugs it.
"""

from __future__ import annotations

import os
import sys
import traceback

EXIT_FAILED = 1
EXIT_REFUSED = 2  # arguments or config refused before any work, as argparse does
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports when the reader went away

# Types whose message is the whole story; any other gets its class name in front, so
# `KeyError: 'x'` does not shrink to a bare `'x'`.
_SELF_EXPLAINING = ("QpackError", "ConfigError", "PoolTooSmall", "PoolExhausted", "PoolBudgetError",
                    "ExpertReadError", "ExpertCorrupt", "HubError", "PortInUse", "DiskSpaceError",
                    "RankLost", "PoolAllocationError", "ContainerDamaged")


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside `exc`, depth first (trio wraps failures in groups)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]
    return [exc]


def root_cause(exc: BaseException) -> BaseException:
    """The first leaf that is not a cancellation echo of another task's failure."""
    leaves = leaf_errors(exc)
    real = [e for e in leaves if type(e).__name__ != "Cancelled" and not isinstance(e, KeyboardInterrupt)]
    return (real or leaves)[0]


def one_line(exc: BaseException) -> str:
    cause = root_cause(exc)
    text = " ".join(str(cause).split()) if str(cause) else ""
    name = type(cause).__name__
    if isinstance(cause, OSError) and not text:
        text = os.strerror(cause.errno) if cause.errno else name
    # By name along the class's bases: a subclass (OutputPathError is a QpackError)
    # explains itself as its base does, and the CLI need not import every module.
    explains = any(c.__name__ in _SELF_EXPLAINING for c in type(cause).__mro__)
    if explains or isinstance(cause, OSError | ValueError) and text:
        return text or name
    return f"{name}: {text}" if text else name


def report(exc: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def broken_pipe() -> int:
    """The reader of stdout went away (`moestream verify x | head`): stop quietly.

    stdout is pointed at /dev/null so that the interpreter's final flush does not
    raise (and print) the same error again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def interrupted_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether every leaf of `exc` is a `kind` (Ctrl-C delivered inside a nursery)."""
    leaves = leaf_errors(exc)
    return bool(leaves) and any(isinstance(e, kind) for e in leaves) and all(
        isinstance(e, kind) or type(e).__name__ == "Cancelled" for e in leaves)


def refused(exc: BaseException) -> int:
    """A command refused before any work (bad config, arguments): one line, exit 2. Plain
    print, not rich: rich wraps long lines at the console width."""
    print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
    return EXIT_REFUSED
