"""What a read is: the `Load` a reader hands back, its error, and the reader's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from actors.pool.eviction import ExpertKey


class ExpertReadError(RuntimeError):
    """An expert could not be read after the configured retries; `key` is (layer, expert)
    and the failed attempt's error is the `__cause__` (what kind of damage it was)."""

    def __init__(self, message: str, key: ExpertKey | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(eq=False, slots=True)
class Load:
    key: ExpertKey
    demand: bool
    done: trio.Event = field(default_factory=trio.Event)
    buffer: np.ndarray | None = None
    staged: Any = None  # what `stage` made of the buffer, on a staging thread
    error: BaseException | None = None
    started: bool = False
    predicted: bool = False  # submitted as a prefetch (whatever it became later)
    read_as_demand: bool = False  # a demand when its read started (predictions yield to it)
    # Installed where it lands (actors/reader.py, "Landing"): the slot it goes to, whether
    # the router allowed it, whether a staging thread did it, and whether the key lost that
    # slot meanwhile (set under the reader's landing lock).
    slot: int = -1
    land: bool = False
    landed: bool = False
    abandoned: bool = False
    # Shelved: taken off the queue before a disk thread started it: its layer was routed without
    # it (actors/router.py, "stale predictions"). Back on the queue when it is wanted.
    shelved: bool = False
    # perf_counter times: submitted, pread started, pread ended, finished (checked/staged).
    t_submit: float = 0.0
    t_start: float = 0.0
    t_read: float = 0.0
    t_done: float = 0.0
    check_s: float = 0.0
    stage_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.t_done - self.t_start if self.t_done else 0.0


@dataclass
class ReaderStats:
    reads: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    bytes_read: int = 0
    retries: int = 0
    failures: int = 0
    landings: int = 0  # reads installed where they landed (actors/reader.py, "Landing")
    shelved: int = 0  # predictions taken off the queue unread (their layer passed them by)
    read_seconds: float = 0.0  # pread started -> blob ready (checked, staged)
    # Where a read's time goes: waiting for a disk thread, the pread itself, waiting
    # for a staging thread, the crc32, the copy into device memory.
    queue_seconds: float = 0.0
    pread_seconds: float = 0.0
    finish_wait_seconds: float = 0.0
    check_seconds: float = 0.0
    stage_seconds: float = 0.0

    def record(self, load: Load, stride: int, begun: float | None) -> None:
        """A load that ended (its `error` set if it failed; `stride`: its layer's bytes a
        read; `begun`: when a staging thread took it up, if one did)."""
        if load.error is not None:
            self.failures += 1
        else:
            self.reads += 1
            self.landings += load.landed
            self.bytes_read += stride
            if load.demand:
                self.demand_reads += 1
            else:
                self.prefetch_reads += 1
        self.queue_seconds += load.t_start - load.t_submit
        self.pread_seconds += load.t_read - load.t_start
        if begun is not None:
            self.finish_wait_seconds += begun - load.t_read
        self.check_seconds += load.check_s
        self.stage_seconds += load.stage_s
        self.read_seconds += load.seconds
