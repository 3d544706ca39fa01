"""A fault-injecting `qpack.reader.ExpertIO` for tests.

It wraps the real positional read (`PosixIO`), so the container, the reader actor, the
router and the engine above it are all the real thing; only the bytes (or the errors)
the disk hands back are changed. Faults are rules matched by (layer, expert), worked
out from the file a descriptor points at and the read's offset, so a test can say
"every read of layer 2 fails with EIO" or "the next 2 reads return a flipped byte".

    io = FaultIO(container_dir)
    rule = io.inject("eio", layer=2, times=None)   # persistent until io.clear()
    async with open_engine(config, io=io) as engine: ...
    assert rule.hits > 0
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qpack import spec
from qpack.reader import PosixIO

FaultKind = Literal["eio", "eof", "short", "slow", "flip"]
KINDS: tuple[FaultKind, ...] = ("eio", "eof", "short", "slow", "flip")


@dataclass
class Rule:
    """One fault. `times=None` fires on every matching read until cleared."""

    kind: FaultKind
    layer: int | None = None
    expert: int | None = None
    times: int | None = None
    delay_s: float = 0.05  # "slow"
    max_bytes: int = 4096  # "short": at most this many bytes per pread call
    hits: int = 0

    def matches(self, layer: int, expert: int) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        return (self.layer is None or self.layer == layer) and (
            self.expert is None or self.expert == expert
        )


class FaultIO:
    """`pread_into` with injected EIO, early EOF, short reads, slow reads and bit flips.

    - eio: raise OSError(EIO) before reading
    - eof: return 0 (the file "ends" here: the container reports a short read)
    - short: return at most `max_bytes` per call (a legal short read; the caller loops)
    - slow: sleep `delay_s`, then read normally
    - flip: read normally, then flip one bit of the first byte returned
    """

    def __init__(self, container: str | os.PathLike[str]) -> None:
        root = Path(container)
        manifest = spec.decode_manifest((root / spec.MANIFEST).read_bytes(), root)
        self._layers = {
            str((root / entry.file).resolve()): (entry.index, entry.stride)
            for entry in manifest.layers
        }
        self._real = PosixIO()
        self._lock = threading.Lock()
        self.rules: list[Rule] = []
        self.reads = 0  # pread calls seen, faulted or not

    def inject(self, kind: FaultKind, *, layer: int | None = None, expert: int | None = None,
               times: int | None = None, delay_s: float = 0.05, max_bytes: int = 4096) -> Rule:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {KINDS}")
        rule = Rule(kind, layer, expert, times, delay_s, max_bytes)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def _where(self, fd: int, offset: int) -> tuple[int, int]:
        path = os.readlink(f"/proc/self/fd/{fd}")
        layer, stride = self._layers.get(path, (-1, 1))
        return layer, offset // stride

    def _fire(self, fd: int, offset: int) -> Rule | None:
        layer, expert = self._where(fd, offset)
        with self._lock:
            self.reads += 1
            for rule in self.rules:
                if rule.matches(layer, expert):
                    rule.hits += 1
                    return rule
        return None

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        rule = self._fire(fd, offset)
        if rule is None:
            return self._real.pread_into(fd, buf, offset)
        if rule.kind == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if rule.kind == "eof":
            return 0
        if rule.kind == "short":
            return self._real.pread_into(fd, buf[: max(1, rule.max_bytes)], offset)
        if rule.kind == "slow":
            time.sleep(rule.delay_s)
            return self._real.pread_into(fd, buf, offset)
        n = self._real.pread_into(fd, buf, offset)
        if n > 0:
            buf[0] ^= 0x01
        return n
