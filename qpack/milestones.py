"""Named steps of a write that a test can stop at, so it signals a pack or a synth at an
exact point instead of racing a process that runs on (or has already finished).

Tests set PAUSE_ENV to "FD:NAME": every milestone passed is written (one line each) to
file descriptor FD and, at milestone NAME, the writer stops until a signal ends it. Unset,
a milestone costs one environment lookup.
"""

from __future__ import annotations

import os
import time

PAUSE_ENV = "QPACK_TEST_PAUSE"


def milestone(name: str) -> None:
    """A step of the write is on disk: "<step> <file>" (begin, wrote N, renamed, journal-tmp,
    journal). Free unless PAUSE_ENV is set."""
    if not (hook := os.environ.get(PAUSE_ENV)):
        return
    fd, _, stop_at = hook.partition(":")
    os.write(int(fd), name.encode() + b"\n")
    # SIGINT raises KeyboardInterrupt here, as it would mid-write. A test that lets the
    # write go on (after filling the disk under it) clears the hook from a signal handler.
    # Short sleeps, not `signal.pause()`: a signal that came after the interpreter's last
    # look for one but before pause(2) left it paused for good (a test's 120 s hang).
    while name == stop_at and os.environ.get(PAUSE_ENV) == hook:
        time.sleep(0.05)
