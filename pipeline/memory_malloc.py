"""Freed host buffers go back to the OS at once: glibc's mmap threshold held at 1 MiB.

On the CPU backend MLX's buffers (weights, states, temporaries) come from malloc. glibc
serves a request of at least its mmap threshold with its own mapping, unmapped on free;
smaller ones come from its arenas, where freed memory stays resident until reused or
trimmed. The threshold starts at 128 KiB and rises to the size of each mapped block
freed (up to 32 MiB), so once the dense core's load has freed its staging, every
temporary and model state under 32 MiB lands in the arenas, and what a step frees stays:
at the 35B's dimensions 60 MiB more at the peak (VmHWM 2,533 -> 2,476 MiB, same run,
2026-12-02). A fixed threshold also turns the dynamic rise off; MLX's own buffer cache
still reuses buffers first, so a step maps little. Set once, before the dense core
loads; glibc only (macOS's allocator returns large blocks by itself), and a threshold
the user set (MALLOC_MMAP_THRESHOLD_) is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import structlog

from actors.libc import glibc

log = structlog.get_logger("moestream.memory")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD_BYTES = 1 << 20
_done = False


def map_large_blocks(threshold: int = THRESHOLD_BYTES) -> bool:
    """Hold glibc's mmap threshold at `threshold` (once per process); whether it was set."""
    global _done
    if _done or not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:  # musl and others have no mallopt
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    log.debug("memory.mmap_threshold", bytes=threshold, set=_done)
    return _done
