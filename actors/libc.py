"""glibc's functions the engine calls directly (madvise, malloc_trim, mallopt), one lookup.

Linux only: elsewhere (macOS's allocator, musl) the caller gets None and does without.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from typing import Any


@functools.cache
def glibc(name: str, argtypes: tuple[Any, ...], restype: Any) -> Callable[..., int] | None:
    """The C library's `name` with its signature set, or None off Linux or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):  # no C library by that name, or musl without `name`
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
