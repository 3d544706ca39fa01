"""A process's resident memory: how much (now, at its peak) and where it lives.

The RSS total says how much; `/proc/self/smaps` says whose: the heap, anonymous mappings (glibc
arenas, MLX's host buffers), the CUDA driver's device files (`/dev/nvidia-uvm` for
managed memory), shared libraries. `moestream bench` records it per case so a memory
regression names its owner instead of only its size.
"""

from __future__ import annotations

import os
import resource
import sys
from collections import Counter

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def current_rss_mb() -> float:
    """Resident set size now; the process peak includes loading (MLX stages every
    dense tensor through host memory at once), which is not what decoding needs."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return peak_rss_mb()


def _label(fields: list[str]) -> str:
    # An smaps header: address perms offset dev inode [pathname].
    if len(fields) < 6:
        return "[anon]"
    path = fields[5]
    if path.startswith("/dev/"):
        return path
    if path.startswith("["):
        return path.split(":")[0] + ("]" if ":" in path else "")
    if ".so" in path:
        return "[libraries]"
    return "[files]"


def resident_by_mapping(top: int = 8, path: str = "/proc/self/smaps") -> dict[str, float]:
    """MiB resident per kind of mapping, the `top` largest; {} where smaps is unreadable."""
    totals: Counter[str] = Counter()
    label = "[anon]"
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if not fields:
                    continue
                if "-" in fields[0] and not fields[0].endswith(":"):
                    label = _label(fields)
                elif fields[0] == "Rss:":
                    totals[label] += int(fields[1])
    except OSError:
        return {}
    return {name: round(kib / 1024, 1) for name, kib in totals.most_common(top) if kib}


def resident_kinds(path: str = "/proc/self/status") -> dict[str, float]:
    """RssAnon / RssFile / RssShmem in MiB (the kernel's own split of RSS)."""
    out: dict[str, float] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key, kib, _unit = line.split()
                    out[key.rstrip(":")] = round(int(kib) / 1024, 1)
    except OSError:
        return {}
    return out
