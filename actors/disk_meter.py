"""How busy the disk is kept: reads in flight over time.

Every expert read brackets its `pread` with `begin()` / `end()` (from the reader's worker
threads, hence the lock: two uncontended lock operations per read). The meter integrates
over wall time, so two snapshots give, for the interval between them, the fraction of
the time at least one read was in flight (the disk's busy fraction as the process sees
it) and the mean number in flight (the queue depth the disk was actually offered).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec

from actors import timeline


class MeterSnapshot(msgspec.Struct, frozen=True):
    t: float  # perf_counter seconds
    busy_s: float  # time with at least one read in flight, since the meter started
    in_flight_s: float  # the integral of reads in flight over time
    reads: int

    def since(self, earlier: MeterSnapshot) -> DiskUse:
        wall = max(self.t - earlier.t, 1e-12)
        return DiskUse(
            seconds=self.t - earlier.t,
            busy_fraction=(self.busy_s - earlier.busy_s) / wall,
            mean_in_flight=(self.in_flight_s - earlier.in_flight_s) / wall,
            reads=self.reads - earlier.reads,
        )


class DiskUse(msgspec.Struct, frozen=True):
    seconds: float
    busy_fraction: float
    mean_in_flight: float
    reads: int


class DiskMeter:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy = 0.0
        self._integral = 0.0
        self._reads = 0
        self._last = clock()

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if self._in_flight:
            self._busy += dt
            self._integral += self._in_flight * dt
        self._last = now

    def begin(self) -> None:
        with self._lock:
            self._advance(self._clock())
            self._in_flight += 1
            n = self._in_flight
        timeline.counter("disk", reads_in_flight=n)

    def end(self) -> None:
        with self._lock:
            self._advance(self._clock())
            self._in_flight -= 1
            self._reads += 1
            n = self._in_flight
        timeline.counter("disk", reads_in_flight=n)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def snapshot(self) -> MeterSnapshot:
        with self._lock:
            now = self._clock()
            self._advance(now)
            return MeterSnapshot(now, self._busy, self._integral, self._reads)
