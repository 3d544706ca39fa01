"""After a read: its checksum, its copy to the device or its landing, off the disk threads.

What a blob needs after its `preadv` (the crc32 on first use, the copy into device memory
on the "load" path, or the DMA into its pool slot when it lands) runs on the staging
threads (`MlxWorker.staging(i)`), never on a disk thread: the next read starts at once.
A staging thread takes every finished read queued for it at once (up to
`MAX_STAGE_BATCH`) and handles them together: the checksums (a failing blob is re-read,
bounded), then one `stage` call for the blobs to copy (one `mx.load`) and one `lander`
call for the blobs that land (their DMAs on the thread's own stream, one wait), then it
hands the batch on to trio (`complete`, ExpertReader's mailbox: one `run_sync_soon` for
whatever arrives before trio takes it).

Measured on the H200. Session 10: batching shortened the wait for a stager (1.36 -> 0.81
ms a read on a page-cache-fast disk). Session 17: landing on the disk threads (session
16's first cut) cost 0.4 ms of each 1.77 ms cold read on the thread that should have
started the next one: two readers kept 1.72 reads in flight and the disk was idle 24 %
of a 1024-token prefill.

Landing and eviction exclude each other through one lock per stripe of slots
(`landing_lock`): the router marks a key's read `abandoned` under its slot's lock when
the key loses the slot, and a batch lands only the reads not abandoned, holding the
locks of all its slots until its copies have ended, so a late landing never writes a
slot's next owner.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from actors import timeline
from actors.mlx_worker import MlxWorker
from actors.pool.eviction import ExpertKey
from actors.read_load import Load

# Blobs one staging thread takes in one go (what it found queued).
MAX_STAGE_BATCH = 16
LANDING_STRIPES = 64

Done = tuple[Load, np.ndarray | None, BaseException | None]
# (slot, layer, blob): a blob into its slot, from any thread (PoolStorage.land).
Lander = Callable[[Sequence[tuple[int, int, np.ndarray]]], None]


class Finisher:
    def __init__(
        self,
        stagers: int,
        *,
        check: Callable[[ExpertKey, np.ndarray], None],
        give_back: Callable[[np.ndarray], None],
        complete: Callable[[trio.lowlevel.TrioToken, list[Done], float], None],
        stage: Callable[[list[np.ndarray]], list[Any]] | None = None,
        lander: Lander | None = None,
    ) -> None:
        """`check(key, buffer)`: the crc32, re-reading a failing blob (raises when it stays
        bad); `complete(token, done, begun)`: on the staging thread, a finished batch to
        hand to trio; `stage`: the copy of several blobs into device memory (one result
        per blob); `lander`: see `Lander`."""
        self.stagers = stagers
        self.stage = stage
        self.lander = lander
        self._check = check
        self._give_back = give_back
        self._complete = complete
        self._next = 0
        self._lock = threading.Lock()
        # Per staging thread: finished reads waiting for it, and whether a drain is queued.
        self._queue: list[deque[tuple[Load, np.ndarray]]] = [deque() for _ in range(stagers)]
        self._queued = [False] * stagers
        self._landing_locks = [threading.Lock() for _ in range(LANDING_STRIPES)]
        # Set while a token waits on the GPU (actors/device_wait.py): nothing lands (a
        # landing is a DMA of this thread's, which the token's context syncs can hold up).
        self.hold = False

    def landing_lock(self, slot: int) -> threading.Lock:
        """The lock a landing into `slot` holds while it checks and copies."""
        return self._landing_locks[slot % LANDING_STRIPES]

    def submit_many(self, token: trio.lowlevel.TrioToken, reads: list[tuple[Load, np.ndarray]]) -> None:
        """From a disk thread (or the ring's): queue finished reads for the staging threads,
        in turn, and each one's drain unless one is already waiting to run (it will find
        these reads too)."""
        wake: list[int] = []
        with self._lock:
            for read in reads:
                stager = self._next
                self._next = (stager + 1) % self.stagers
                self._queue[stager].append(read)
                if not self._queued[stager]:
                    self._queued[stager] = True
                    wake.append(stager)
        for stager in wake:
            MlxWorker.staging(stager).submit(functools.partial(self._drain, token, stager))

    def _drain(self, token: trio.lowlevel.TrioToken, stager: int) -> None:
        """On staging thread `stager`: every read queued for it, in batches, until none."""
        while True:
            with self._lock:
                queue = self._queue[stager]
                if not queue:
                    self._queued[stager] = False
                    return
                batch = [queue.popleft() for _ in range(min(len(queue), MAX_STAGE_BATCH))]
            self._finish(token, stager, batch)

    def _finish(self, token: trio.lowlevel.TrioToken, stager: int,
                batch: list[tuple[Load, np.ndarray]]) -> None:
        """The blobs' checksums, then their copy or their landing, together."""
        begun = time.perf_counter()
        done: list[Done] = []
        good: list[tuple[Load, np.ndarray]] = []
        with timeline.span(f"stager-{stager}", "finish", layer=batch[0][0].key[0], blobs=len(batch)):
            for load, buffer in batch:
                started = time.perf_counter()
                try:
                    self._check(load.key, buffer)
                except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the load
                    done.append((load, buffer, exc))
                    continue
                load.check_s = time.perf_counter() - started
                good.append((load, buffer))
            # A read is marked `land` only where there is a lander (ExpertReader.submit).
            hold = self.hold  # read once: a token waiting on the GPU pulls them instead
            landing = [(load, buffer) for load, buffer in good if load.land and not hold]
            rest = [(load, buffer) for load, buffer in good if not load.land or hold]
            if landing:
                done.extend(self._land(landing))
            done.extend(self._stage(rest))
        finished = time.perf_counter()
        for load, _, _ in done:
            load.t_done = finished
        self._complete(token, done, begun)

    def _stage(self, batch: list[tuple[Load, np.ndarray]]) -> list[Done]:
        if self.stage is None or not batch:
            return [(load, buffer, None) for load, buffer in batch]
        started = time.perf_counter()
        try:
            staged = self.stage([buffer for _, buffer in batch])
        except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the loads
            return [(load, buffer, exc) for load, buffer in batch]
        share = (time.perf_counter() - started) / len(batch)
        for (load, _), blob in zip(batch, staged, strict=True):
            load.staged = blob
            load.stage_s = share
        return [(load, buffer, None) for load, buffer in batch]

    def _land(self, batch: list[tuple[Load, np.ndarray]]) -> list[Done]:
        """The blobs whose keys still hold their slots, into those slots together; their
        buffers back at once. An abandoned read writes nothing and keeps its buffer (the
        router gives it back)."""
        assert self.lander is not None
        stripes = sorted({load.slot % LANDING_STRIPES for load, _ in batch})
        for stripe in stripes:  # in order: two batches never wait on each other
            self._landing_locks[stripe].acquire()
        try:
            live = [(load, buffer) for load, buffer in batch if not load.abandoned]
            started = time.perf_counter()
            try:
                with timeline.span("landing", "land", layer=batch[0][0].key[0], blobs=len(live)):
                    self.lander([(load.slot, load.key[0], buffer) for load, buffer in live])
            except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the loads
                return [(load, buffer, exc if not load.abandoned else None) for load, buffer in batch]
            share = (time.perf_counter() - started) / max(len(live), 1)
            for load, _ in live:
                load.landed = True
                load.stage_s = share
        finally:
            for stripe in stripes:
                self._landing_locks[stripe].release()
        done: list[Done] = []
        for load, buffer in batch:
            if load.landed:
                self._give_back(buffer)
                done.append((load, None, None))
            else:
                done.append((load, buffer, None))
        return done
