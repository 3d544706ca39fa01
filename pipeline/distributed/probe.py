"""What a rank measures about itself before the layers are split (`split = "weighted"`).

Free memory decides how much dense core and pool fit; disk read speed how fast its
experts stream. Both are rough (one short read, one look at free memory): they weigh
ranks that differ a lot (a 64 GB and a 128 GB Mac, an SSD and a network disk), not
ranks that differ by a few percent.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from qpack.reader import Container

PROBE_BYTES = 32 << 20


def free_memory_mb() -> float:
    """The memory an expert pool may take here: the GPU's on CUDA, else available RAM
    (less what the engine keeps aside), as the pool's own sizing counts it."""
    from pipeline.memory_budget import pool_memory_room

    room, _ = pool_memory_room(0)
    return max(room, 1) / 2**20


def read_speed_mb_s(container: Container, limit: int = PROBE_BYTES) -> float:
    """MB/s of one sequential read of the first expert file's head, dropped from the page
    cache first where the OS allows (a cached read would measure memory, not the disk)."""
    path = container.root / container.manifest.layers[0].file
    fd = os.open(path, os.O_RDONLY)
    try:
        size = min(limit, os.fstat(fd).st_size)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        done = 0
        while done < size:
            chunk = os.pread(fd, min(4 << 20, size - done), done)
            if not chunk:
                break
            done += len(chunk)
        seconds = max(time.perf_counter() - start, 1e-6)
    finally:
        os.close(fd)
    return done / seconds / 1e6


def host_id() -> int:
    """This machine, cut to 24 bits (exact in the handshake's float32): its name and, on
    Linux, its boot id, so ranks launched on one host find each other."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    mark = socket.gethostname() + (boot.read_text().strip() if boot.exists() else "")
    return zlib.crc32(mark.encode()) & 0xFFFFFF


def fingerprint(container: Container) -> int:
    """The manifest's crc32, cut to 24 bits (exact in the float32 the handshake sums)."""
    return zlib.crc32((container.root / "manifest.json").read_bytes()) & 0xFFFFFF


def kept_bytes(dense_path: Path, keep: Callable[[str], bool]) -> int:
    """Bytes of the dense tensors `keep` selects, from the safetensors header alone."""
    with open(dense_path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(end - start for name, entry in header.items() if name != "__metadata__"
               and keep(name) for start, end in [entry["data_offsets"]])
