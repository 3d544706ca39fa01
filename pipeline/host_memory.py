"""Give MLX's transient host buffers back to the operating system.

On CUDA, MLX stages every tensor it loads, and every expert blob `device_staging`
copies, through a malloc'd host buffer that is freed once its DMA completes. glibc
raises its mmap threshold after the first such free, so later buffers come from the
heap, whose freed space stays in the RSS: a 35B-dim run held ~3 GB of dead staging
memory while decoding. A fixed threshold keeps large buffers mmapped (a free unmaps
them), and a trim after loading hands back what the dense core's load left behind.
Nothing here changes what MLX computes; on other C libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import structlog

log = structlog.get_logger("moestream.host_memory")

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def pin_mmap_threshold(nbytes: int = 256 * 1024) -> bool:
    """Serve allocations of `nbytes` and more by mmap, always (True if glibc took it)."""
    libc = _libc()
    ok = bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, nbytes))
    log.debug("host_memory.mmap_threshold", bytes=nbytes, ok=ok)
    return ok


def trim() -> bool:
    """Return the heap's free pages to the OS (True if any were released)."""
    libc = _libc()
    return bool(libc and libc.malloc_trim(0))
