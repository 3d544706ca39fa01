"""Give freed host memory back to the OS after a generation (glibc's `malloc_trim`).

MLX's CUDA backend compiles a kernel the first time it meets a shape; on a machine
whose kernel cache is empty that is minutes of NVRTC work, and the memory it frees stays
in glibc's arenas: on the H200, a 35B-dim engine's RSS while decoding was 5.5 GB after
compiling and 2.5 GB in the next process, which loaded the same kernels from the cache.
A long-lived server would hold those gigabytes for its whole life. `malloc_trim(0)`
returns free arena pages; it walks every arena, so it runs only when RSS has grown, or
when the arenas hold much free memory. The second is a server's steady state: requests of
every size free buffers under glibc's mmap threshold (pipeline/memory_malloc.py) in the
middle of the arenas, and RSS rose 200-450 MiB/hour in 22-25 minute soaks of the demo
server (2026-12-05, benchmarks/results/soak/) while its live memory stayed flat: at one idle
moment 217 MiB of the arenas were free and one `malloc_trim(0)` took RSS 773 -> 590 MiB,
yet the growth rule had not fired, each trim having raised its own floor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import structlog

from actors.libc import glibc
from pipeline.resident_map import current_rss_mb

log = structlog.get_logger(__name__)

GROWTH_MB = 256.0  # trim once RSS is this far above what the last trim left ...
FREE_MB = 64.0  # ... or once this much of the arenas is free


def malloc_trim() -> Callable[..., int] | None:
    """glibc's malloc_trim (None where there is none)."""
    return glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def arena_free_mb() -> float | None:
    """Free bytes in glibc's arenas, in MiB (mallinfo2's fordblks: every arena's); None
    where there is no mallinfo2 (glibc < 2.33, other C libraries)."""
    info = glibc("mallinfo2", (), _Mallinfo2)
    if info is None:
        return None
    return float(info().fordblks) / 2**20  # type: ignore[attr-defined]


class HeapTrimmer:
    def __init__(self) -> None:
        self._trim = malloc_trim()
        self._floor = current_rss_mb()
        self.trimmed_mb = 0.0  # given back so far

    def maybe_trim(self) -> float:
        """Trim if RSS grew by GROWTH_MB since the last trim or FREE_MB of the arenas are
        free; MiB given back (0 if none)."""
        if self._trim is None:
            return 0.0
        before = current_rss_mb()
        if before < self._floor + GROWTH_MB and (arena_free_mb() or 0.0) < FREE_MB:
            return 0.0
        self._trim(0)
        after = current_rss_mb()
        self._floor = after
        log.info("heap.trimmed", rss_before_mb=round(before), rss_after_mb=round(after))
        given = max(before - after, 0.0)
        self.trimmed_mb += given
        return given
