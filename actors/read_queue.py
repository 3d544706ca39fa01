"""The reader's queues and staging buffers, under one lock: trio submits, the disk takes.

Two queues, demand before prediction; a disk thread takes the next load itself, with a
free staging buffer, so the disk never waits for the event loop. Threads come in lanes
(actors/reader.py says why): the queue's (either kind), the demand lane's (demand only),
the bulk lane's (either, only while `bulk` is set: a prompt's prefill). The ring
(actors/ring_reads.py) takes the same loads in the same order, the lanes as capacities.
With `prefetch_yields`, no prediction starts while a demand read runs. A prediction that
becomes a demand before it starts is promoted (moved to the demand queue), one already
running is simply waited on; a queued prediction whose layer was routed without it is
shelved (off the queue, unread) and requeued or promoted when wanted again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from actors.read_load import Load, ReaderStats

# A disk thread's lane: the queue (demand first, then predictions), demand reads only, or
# the queue again but only while `bulk` is set.
QUEUE, DEMAND, BULK = "queue", "demand", "bulk"


class ReadQueue:
    def __init__(self, buffers: list[np.ndarray], *, concurrency: int, demand_lane: int,
                 bulk_lane: int, prefetch_yields: bool, stats: ReaderStats) -> None:
        self.free = buffers
        self.concurrency = concurrency
        self.demand_lane = demand_lane
        self.bulk_lane = bulk_lane
        self.prefetch_yields = prefetch_yields
        self.stats = stats
        self.demand: deque[Load] = deque()
        self.prefetch: deque[Load] = deque()
        self.bulk = False  # the bulk lane reads
        self.closed = False
        self.demand_reading = 0  # demand reads between their start and their pread's end
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._lane_cond = threading.Condition(lock)  # the demand lane's threads wait here
        self._bulk_cond = threading.Condition(lock)  # the bulk lane's
        self._conds = {QUEUE: self._cond, DEMAND: self._lane_cond, BULK: self._bulk_cond}
        # Wakes the ring's thread (blocked in the kernel, not on a condition) after a
        # change; None with threads. Only once per sleep: `asleep` is set under the lock
        # by the ring's last `take_many` before it blocks, so no change is missed.
        self.wake: Callable[[], None] | None = None
        self.asleep = False

    def _rouse(self) -> bool:
        """Under the lock, after a change: whether the ring's thread must be woken."""
        if self.asleep and self.wake is not None:
            self.asleep = False
            return True
        return False

    def _poke(self, rouse: bool) -> None:
        if rouse and self.wake is not None:
            self.wake()

    # -- from trio (and the staging threads: give_back) -------------------------------------

    def submit(self, loads: list[Load], demand: bool) -> None:
        with self._cond:
            (self.demand if demand else self.prefetch).extend(loads)
            self._cond.notify(len(loads))
            if demand:
                self._lane_cond.notify(len(loads))
            if self.bulk:
                self._bulk_cond.notify(len(loads))
            rouse = self._rouse()
        self._poke(rouse)

    def promote(self, load: Load) -> None:
        """A queued (or shelved) prediction is now needed: to the front of the line."""
        with self._cond:
            if not load.shelved and (load.demand or load.started or load.done.is_set()):
                load.demand = True
                return
            load.demand = True
            if load.shelved:
                load.shelved, load.t_submit = False, time.perf_counter()
            else:
                self.prefetch.remove(load)
            self.demand.append(load)
            self._cond.notify()  # without a lane, a queue thread must take it
            self._lane_cond.notify()
            self._bulk_cond.notify()
            rouse = self._rouse()
        self._poke(rouse)

    def shelve(self, loads: list[Load]) -> int:
        """Queued predictions off the queue before a disk thread starts them (a started one
        is simply read); how many."""
        with self._cond:
            gone = {load for load in loads if not (load.started or load.demand or load.shelved)}
            if not gone:
                return 0
            self.prefetch = deque(load for load in self.prefetch if load not in gone)
            for load in gone:
                load.shelved = True
            self.stats.shelved += len(gone)
        return len(gone)

    def requeue(self, loads: list[Load]) -> list[Load]:
        """Shelved predictions back on the queue, as predictions; those that were shelved."""
        back = []
        with self._cond:
            for load in loads:
                if load.shelved:
                    load.shelved, load.t_submit = False, time.perf_counter()
                    self.prefetch.append(load)
                    back.append(load)
            rouse = False
            if back:
                self._cond.notify_all()
                if self.bulk:
                    self._bulk_cond.notify_all()
                rouse = self._rouse()
        self._poke(rouse)
        return back

    def give_back(self, buffer: np.ndarray) -> None:
        with self._cond:
            self.free.append(buffer)
            self._cond.notify()
            if self.demand:
                self._lane_cond.notify()
            if self.bulk:
                self._bulk_cond.notify()
            # Only a read waiting for a buffer needs the ring now.
            rouse = bool(self.demand or self.prefetch) and self._rouse()
        self._poke(rouse)

    def set_bulk(self, on: bool) -> None:
        with self._cond:
            self.bulk = on
            if on:
                self._bulk_cond.notify_all()
            rouse = on and bool(self.demand or self.prefetch) and self._rouse()
        self._poke(rouse)

    def open(self) -> None:
        with self._cond:
            self.closed = False

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            self._lane_cond.notify_all()
            self._bulk_cond.notify_all()
        self._poke(True)  # awake or not: it must see `closed` before it blocks again

    def retry(self, loads: list[Load], buffers: list[np.ndarray]) -> None:
        """From the ring's thread, after the ring failed: `loads` (started, never ended)
        to the front of their queues, `buffers` in place of theirs, and from now on the
        disk threads' conditions, not the ring's wake-ups."""
        with self._cond:
            self.wake, self.asleep = None, False
            self.free.extend(buffers)
            for load in reversed(loads):
                if load.read_as_demand:
                    self.demand_reading -= 1
                load.started = load.read_as_demand = False
                (self.demand if load.demand else self.prefetch).appendleft(load)
            for cond in self._conds.values():
                cond.notify_all()

    # -- from the disk threads, or the ring's ---------------------------------------------

    def take(self, lane: str) -> tuple[Load, np.ndarray] | None:
        """The next load a thread of `lane` may read and a free buffer, waiting for them;
        None once closed."""
        cond = self._conds[lane]
        with cond:
            while not self.closed and not (self._may_take(lane) and self.free):
                cond.wait()
            if self.closed:
                return None
            return self._started(self.demand.popleft() if self.demand else self.prefetch.popleft())

    def take_many(self, in_flight: int) -> list[tuple[Load, np.ndarray]] | None:
        """The ring's `take`: every load that may start beside `in_flight` reads (the lanes
        as capacities: `concurrency` reads of any kind, `demand_lane` more for demand
        reads, `bulk_lane` more while `bulk`), each with a free buffer; None once closed."""
        taken: list[tuple[Load, np.ndarray]] = []
        with self._cond:
            if self.closed:
                return None
            anything = self.concurrency + (self.bulk_lane if self.bulk else 0)
            while self.free:
                n = in_flight + len(taken)
                if self.demand and n < anything + self.demand_lane:
                    load = self.demand.popleft()
                elif (self.prefetch and n < anything
                      and not (self.prefetch_yields and self.demand_reading)):
                    load = self.prefetch.popleft()
                else:
                    break
                taken.append(self._started(load))
            self.asleep = True  # it blocks next, until a read ends or a change wakes it
        return taken

    def _started(self, load: Load) -> tuple[Load, np.ndarray]:
        """Under the lock: `load` leaves the queues with a buffer."""
        if load.demand:
            load.read_as_demand = True
            self.demand_reading += 1
        # Off the queue now: a promotion from here on must not look for it there.
        load.started = True
        return load, self.free.pop()

    def _may_take(self, lane: str) -> bool:
        if lane == BULK and not self.bulk:
            return False
        prefetch = (bool(self.prefetch) and lane != DEMAND
                    and not (self.prefetch_yields and self.demand_reading))
        return bool(self.demand) or prefetch

    def read_done(self, load: Load) -> None:
        """A read ended: predictions held back for it may start."""
        if not load.read_as_demand:
            return
        with self._cond:
            self.demand_reading -= 1
            if not self.demand_reading and (self.prefetch or self.demand):
                self._cond.notify_all()
                if self.bulk:
                    self._bulk_cond.notify_all()

    def count_retry(self) -> None:
        with self._cond:
            self.stats.retries += 1
