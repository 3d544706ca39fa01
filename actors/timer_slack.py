"""A thread's timer slack, made fine for short sleeps (Linux).

Linux lets a sleeping thread wake up to its "timer slack" late, 50 us by default, so a
`time.sleep(20e-6)` sleeps ~70 us. The event loop's short sleeps between two looks at a
waiting GPU's mailbox (actors/awaited.py) want what they ask for; `prctl(PR_SET_TIMERSLACK)`
sets it for the calling thread only. Elsewhere (macOS, a libc without prctl) a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_PR_SET_TIMERSLACK = 29
SLACK_NS = 1000


def fine_timer_slack() -> bool:
    """The calling thread's timer slack to `SLACK_NS` (a system call: cheap enough once a
    token); False where it cannot be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(_libc().prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(SLACK_NS), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
