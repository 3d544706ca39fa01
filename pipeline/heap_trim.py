"""Give freed host memory back to the OS after a generation (glibc's `malloc_trim`).

MLX's CUDA backend compiles a kernel the first time it meets a shape; on a machine
whose kernel cache is empty that is minutes of NVRTC work, and the memory it frees stays
in glibc's arenas: on the H200, a 35B-dim engine's RSS while decoding was 5.5 GB after
compiling and 2.5 GB in the next process, which loaded the same kernels from the cache.
A long-lived server would hold those gigabytes for its whole life. `malloc_trim(0)`
returns free arena pages; it walks every arena (5-45 ms for 100-300 MiB of holes on the
project VM), so it runs only when it has something to give:
- when the engine goes idle (its last running generation ended, done, failed or
  cancelled, and nothing waits: `ComputeTask`'s `on_idle`), once RSS is IDLE_GROWTH_MB
  above what the last such trim left. Until session 30 only a generation that finished
  alone trimmed, so a server whose clients often went away mid-generation (the soak's
  cancels) kept its idle holes. A server's steady traffic leaves
  holes in the arenas (buffers of every size under glibc's mmap threshold,
  pipeline/memory_malloc.py): in 22-25 minute soaks of the demo server (2026-12-05,
  benchmarks/results/soak/) RSS rose 200-450 MiB/hour while the live memory stayed flat
  (malloc's in-use bytes, MLX's active memory, Python's objects, the prefix cache's states),
  217 MiB of the arenas free at one idle moment, and one `malloc_trim(0)` took RSS 773 ->
  590 MiB. Trimmed while other generations run, what they hold sets the floor: a 64 MiB
  step there left the idle RSS climbing as before.
- after any generation, once RSS is GROWTH_MB above the last trim's result (a busy server,
  the compiler's gigabytes).
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
IDLE_GROWTH_MB = 16.0  # ... or, the engine gone idle, above the last such trim's


def malloc_trim() -> Callable[..., int] | None:
    """glibc's malloc_trim (None where there is none)."""
    return glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


class HeapTrimmer:
    def __init__(self) -> None:
        self._trim = malloc_trim()
        self._floor = self._idle_floor = current_rss_mb()
        self.trimmed_mb = 0.0  # given back so far

    def maybe_trim(self, alone: bool = False) -> float:
        """Trim if RSS grew by GROWTH_MB since the last trim, or `alone` (nothing else
        running or waiting) by IDLE_GROWTH_MB since the last trim when alone; MiB given
        back (0 if none)."""
        if self._trim is None:
            return 0.0
        before = current_rss_mb()
        if before < self._floor + GROWTH_MB and not (alone and before >= self._idle_floor + IDLE_GROWTH_MB):
            return 0.0
        self._trim(0)
        after = current_rss_mb()
        self._floor = after
        if alone:
            self._idle_floor = after
        log.info("heap.trimmed", rss_before_mb=round(before), rss_after_mb=round(after))
        given = max(before - after, 0.0)
        self.trimmed_mb += given
        return given
