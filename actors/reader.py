"""The reader actor: expert reads from the container into staging buffers.

`concurrency` disk threads each keep one blocking `preadv` in flight: the number of
threads is the queue depth the disk is offered. `demand_lane` more threads take demand
reads only: a read the compute waits for starts at once even when every other thread
is busy with a prediction (with realistic routing, ~40 % of a layer's experts are not
predicted, and each waited behind a prefetch read already in flight). With
`prefetch_yields`, no prediction starts while a demand read is running, so the reads the
compute waits for have the disk to themselves (reads in flight share its bandwidth: a
demand read beside a prediction took twice as long). `bulk_lane` more threads read only
while `bulk` is set (a prompt's prefill, which wants the disk's bandwidth, not one read's
latency): the depth a decode wants is the smallest that nearly reaches the bandwidth,
a prefill's the one that reaches it (on the H200 a probe saw 2.7 GB/s at depth 8 where
the chosen 2 moved 2.06, the disk busy 98 % of a 1024-token prefill: session 17). A
thread that finishes a read takes the next load itself, under one lock, demand before
prefetch, so the disk is never left waiting for the event loop; a prefetch that becomes a
demand before it starts is promoted, one already running is simply waited on (never
issued twice): the queues, lanes and buffers are actors/read_queue.py's. With
`io = "uring"` one thread keeps all of them in flight through an io_uring instead
(actors/ring_reads.py).

What a blob needs after the read (its crc32 on first use, its copy into device memory,
or its landing) runs on the staging threads (actors/read_finish.py), never on a disk
thread: the next read starts at once. Per layer, the event loop does a queue operation to
submit its reads and a callback per batch that ended (one mailbox: `_to_trio`); the rest
happens in threads. With a `lander` (the pool's memory written from any thread), a read
the router marked `land` is installed into its slot by a staging thread as soon as it
ends, its buffer free again at once (on the H200 the installs had been 64 of a fast
disk's 167 ms a token: session 16); when a read may land, and how a late one never writes
a slot's next owner: actors/router.py and actors/read_finish.py.

A prediction still queued when its layer is routed without it is `shelve`d (taken off
the queue, unread) and `requeue`d or `promote`d when wanted again (actors/shelf.py).

A read that fails is retried a bounded number of times, then reported on its `Load`.
A blob that fails its checksum is re-read (the same bounded retries) on its staging
thread, off the disk threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import structlog
import trio

from actors import timeline
from actors.disk_meter import DiskMeter
from actors.pool.eviction import ExpertKey
from actors.read_finish import Done, Finisher, Lander
from actors.read_load import ExpertReadError, Load, ReaderStats
from actors.read_queue import BULK, DEMAND, QUEUE, ReadQueue
from actors.ring_reads import RingReads
from actors.switch_interval import SWITCH_INTERVAL_S, shortened
from qpack.reader import Container, aligned_empty

log = structlog.get_logger("moestream.reader")
# Staging threads touch MLX (each keeps its streams for life), so there are few of them;
# a 1.7 MiB blob's copy to the H200 takes ~0.6 ms, so 4 keep up with ~10 GB/s of reads.
MAX_STAGERS = 4


class ExpertReader:
    def __init__(
        self,
        container: Container,
        *,
        concurrency: int,
        demand_lane: int = 0,
        bulk_lane: int = 0,
        prefetch_yields: bool = False,
        retries: int = 2,
        retry_backoff_s: float = 0.01,
        buffers: int | None = None,
        stage: Callable[[list[np.ndarray]], list[Any]] | None = None,
        switch_interval_s: float | None = SWITCH_INTERVAL_S,
        stride: int | None = None,
        register: Callable[[np.ndarray], object] | None = None,
        lander: Lander | None = None,
        io: Literal["threads", "uring"] = "threads",
        gil_hand_over: bool = False,
    ) -> None:
        """`stride`: the largest blob its buffers must hold (default: the model's layers';
        more when it also reads the MTP head's experts). `register`: called on every
        staging buffer once (the direct copy path page-locks them). `lander`: writes blobs
        into their slots from a staging thread (see "Landing"). `stage`: the host->device
        copy of several finished blobs off the MLX thread (one result per blob, in order).
        `io`: "threads" (one blocking read per disk thread) or "uring" (one thread keeping
        every read in flight through an io_uring: actors/ring_reads.py; threads where the
        platform refuses it). `gil_hand_over`: see `hand_over`."""
        self.switch_interval_s = switch_interval_s
        self.gil_hand_over = gil_hand_over
        # Decided here, so the engine's facts say what runs: threads where no ring can be had.
        self.io: Literal["threads", "uring"] = (
            "uring" if io == "uring" and RingReads.usable(container) else "threads")
        self.container = container
        self.concurrency = concurrency
        self.demand_lane = demand_lane
        self.bulk_lane = bulk_lane
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        stride = stride or container.manifest.max_stride
        # Enough staging for installs to come in batches while reads continue.
        count = buffers if buffers is not None else max(4 * concurrency, 16)
        # Page-aligned, so the same buffers serve O_DIRECT reads.
        self._stride, self._register = stride, register
        free = self._buffers(count)
        self.stats = ReaderStats()
        self.queue = ReadQueue(free, concurrency=concurrency, demand_lane=demand_lane,
                               bulk_lane=bulk_lane, prefetch_yields=prefetch_yields, stats=self.stats)
        self._any_done = trio.Event()
        self._threads: list[threading.Thread] = []  # the disk threads, or the ring's
        self._ring: RingReads | None = None  # while the ring's thread reads
        self.finisher = Finisher(max(1, min(MAX_STAGERS, concurrency)), check=self._check,
                                 give_back=self.give_back, complete=self._to_trio,
                                 stage=stage, lander=lander)
        self.meter = DiskMeter()
        # Finished loads on their way to trio (`_to_trio`).
        self._mail_lock = threading.Lock()
        self._mail: list[tuple[list[Done], float | None]] = []
        self._mail_sent = False
        self.on_done: Callable[[], None] | None = None  # after loads end (once a batch), on trio

    def _buffers(self, count: int) -> list[np.ndarray]:
        """`count` staging buffers: page-aligned, so they serve O_DIRECT reads too."""
        free = [aligned_empty(self._stride) for _ in range(count)]
        if self._register is not None:
            for buffer in free:
                self._register(buffer)
        return free

    @property
    def stage(self) -> Callable[[list[np.ndarray]], list[Any]] | None:
        return self.finisher.stage

    @property
    def lander(self) -> Lander | None:
        return self.finisher.lander

    @property
    def prefill_readers(self) -> int:
        """Disk threads reading while a prompt's chunk runs (the bulk lane's too)."""
        return self.concurrency + self.bulk_lane

    def landing_lock(self, slot: int) -> threading.Lock:
        """The lock a landing into `slot` holds while it checks and copies."""
        return self.finisher.landing_lock(slot)

    @property
    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self.queue.free)

    async def run(self) -> None:
        """The actor's body: `concurrency` disk threads, until cancelled."""
        token = trio.lowlevel.current_trio_token()
        self.queue.open()
        with self._mail_lock:  # a run before may have ended with its mail undelivered
            self._mail, self._mail_sent = [], False
        ring = self._ring = RingReads.open(self) if self.io == "uring" else None  # None: refused
        if ring is not None:
            self.queue.wake = ring.wake
            self._threads = [threading.Thread(target=ring.run, args=(token,), daemon=True,
                                              name="moestream-read-ring")]
        else:
            self.io, self.queue.wake = "threads", None
            self._threads = self._disk_threads(token)
        for thread in self._threads:
            thread.start()
        try:
            with shortened(self.switch_interval_s):
                await trio.sleep_forever()
        finally:
            self.queue.close()
            # A read in flight ends in milliseconds; a hung disk must not hold shutdown.
            # The ring's thread first: where the ring failed it appended disk threads, which
            # the loop then reaches (a list's iterator sees what is appended meanwhile).
            deadline = time.monotonic() + 2.0
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _disk_threads(self, token: trio.lowlevel.TrioToken) -> list[threading.Thread]:
        lanes = [QUEUE] * self.concurrency + [DEMAND] * self.demand_lane + [BULK] * self.bulk_lane
        return [threading.Thread(target=self._disk_thread, args=(i, token, lane),
                                 daemon=True, name=f"moestream-read-{i}")
                for i, lane in enumerate(lanes)]

    def fall_back(self, token: trio.lowlevel.TrioToken, lost: list[Load]) -> None:
        """On the ring's thread, after the ring itself failed: the reads it lost go back
        to the front of their queues, each with a fresh buffer in place of one the
        kernel may still write into, and disk threads take over from here."""
        self.io, self._ring = "threads", None
        self.queue.retry(lost, self._buffers(len(lost)))
        threads = self._disk_threads(token)
        self._threads.extend(threads)
        for thread in threads:
            thread.start()

    def submit(self, key: ExpertKey, *, demand: bool, slot: int = -1, land: bool = False) -> Load:
        """Queue a read of `key`; with `land` (and a lander), installed into `slot` where
        it lands."""
        return self.submit_many([(key, slot)], demand=demand, land=land)[0]

    def submit_many(self, reads: list[tuple[ExpertKey, int]], *, demand: bool,
                    land: bool = False) -> list[Load]:
        """`submit` for several (key, slot) reads, under one lock and one wake-up per
        queue: a layer's placement submits its reads together."""
        now = time.perf_counter()
        land = land and self.lander is not None
        loads = [Load(key, demand, predicted=not demand, t_submit=now, slot=slot, land=land)
                 for key, slot in reads]
        if loads:
            self.queue.submit(loads, demand)
        return loads

    def hand_over(self) -> None:
        """After a batch of `submit`s, on the trio thread, with `gil_hand_over`: the GIL to
        the disk threads they woke, whose preads start now, not after the event loop's next
        switch interval of Python (benchmarks/gil_handover.py: 0.33 ms -> 0.03 ms on this
        VM). Off by default: in the engine the event loop then waits to get the GIL back
        behind whichever thread took it (20 % of its time in a sampling profile) and the
        page cache's decode ran 10.15-10.71 tok/s with it against 11.65-11.81 without
        (this VM, session 27; docs/results.md, seventeenth pass); the waited path, the
        same either way."""
        if self.gil_hand_over:
            time.sleep(0)

    @contextmanager
    def bulk(self, on: bool = True) -> Iterator[None]:
        """While inside (and `on`), the bulk lane reads: compute's prompt chunks."""
        if not on:
            yield
            return
        self.queue.set_bulk(True)
        try:
            yield
        finally:
            self.queue.set_bulk(False)

    def promote(self, load: Load) -> None:
        """A queued (or shelved) prefetch is now needed: move it to the front of the line."""
        self.queue.promote(load)

    def shelve(self, loads: list[Load]) -> int:
        """Take queued predictions off the queue before a disk thread starts them (a
        started one is simply read). How many were shelved; each keeps its slot and
        goes back with `promote` or `requeue`."""
        return self.queue.shelve(loads)

    def requeue(self, loads: list[Load]) -> int:
        """Shelved predictions predicted again (or to be finished): back on the queue, as
        predictions. How many were shelved."""
        return len(self.queue.requeue(loads))

    @property
    def starved(self) -> bool:
        """Every staging buffer holds a finished blob or a read: installs must free some."""
        return not self.queue.free

    async def wait_any(self) -> None:
        """Until the next load finishes (whichever it is)."""
        await self._any_done.wait()

    def give_back(self, buffer: np.ndarray) -> None:
        self.queue.give_back(buffer)

    # -- the disk threads -------------------------------------------------------------------

    def _disk_thread(self, index: int, token: trio.lowlevel.TrioToken, lane: str) -> None:
        while (taken := self.queue.take(lane)) is not None:
            load, buffer = taken
            load.t_start = time.perf_counter()
            error: BaseException | None = None
            try:
                with timeline.span(f"reader-{index}", "read" if load.demand else "prefetch",
                                   layer=load.key[0], expert=load.key[1]):
                    self.read(load.key, buffer)
            except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the load
                error = exc
            self.after_reads(token, [(load, buffer, error)])

    def after_reads(self, token: trio.lowlevel.TrioToken, ended: list[Done]) -> None:
        """Reads that ended (one on a disk thread, or the ring's batch): predictions held
        back for them may start, and each blob goes on to a staging thread or straight to
        trio, with one hand-over to the staging threads and at most one to trio."""
        now = time.perf_counter()
        direct: list[Done] = []
        staged: list[tuple[Load, np.ndarray]] = []
        # While a token waits on the GPU nothing lands (Finisher.hold): a read with nothing
        # else to do then goes straight to trio, not through a staging thread's hop and
        # its own turn at the GIL (the fast disk's every read, actors/awaited.py).
        hold = self.finisher.hold
        for load, buffer, error in ended:
            load.t_read = now
            self.queue.read_done(load)
            layer, expert = load.key
            if error is not None or buffer is None or (
                    self.stage is None and (not load.land or hold)
                    and not self.container.needs_check(layer, expert)):
                load.t_done = now
                direct.append((load, buffer, error))
            else:
                staged.append((load, buffer))
        if staged:
            self.finisher.submit_many(token, staged)
        if direct:
            self._to_trio(token, direct, None)

    def _to_trio(self, token: trio.lowlevel.TrioToken, done: list[Done], begun: float | None) -> None:
        """From a disk, ring or staging thread: finished loads into the mailbox, and one
        `run_sync_soon` to empty it unless one is already on its way (each is a write to
        trio's wake-up socket, a read of it and a scheduling round on the event loop)."""
        with self._mail_lock:
            self._mail.append((done, begun))
            if self._mail_sent:
                return
            self._mail_sent = True
        try:
            token.run_sync_soon(self._empty_mail)
        except trio.RunFinishedError:  # the engine is gone: nobody waits for these loads
            with self._mail_lock:
                self._mail.clear()
                self._mail_sent = False

    def _empty_mail(self) -> None:
        with self._mail_lock:
            mail, self._mail = self._mail, []
            self._mail_sent = False
        for done, begun in mail:
            for load, buffer, error in done:
                self._complete(load, buffer, error, begun)
        if mail:  # waiters and the router's hook once for all of them
            self._any_done.set()
            self._any_done = trio.Event()
            if self.on_done is not None:
                self.on_done()

    def read(self, key: ExpertKey, buffer: np.ndarray) -> None:
        """Blocking, in a disk thread: one read, retried on failure with a short backoff."""
        self._with_retries(key, lambda _attempt: self._pread(key, buffer))

    def _pread(self, key: ExpertKey, buffer: np.ndarray) -> None:
        self.meter.begin()
        try:
            self.container.read_expert(*key, buffer, check=False)
        finally:
            self.meter.end()

    def _with_retries(self, key: ExpertKey, attempt: Callable[[int], None]) -> None:
        """`attempt(n)` until it succeeds, at most `retries` more times, backing off."""
        layer, expert = key
        for n in range(self.retries + 1):
            try:
                attempt(n)
                return
            except Exception as exc:
                if n == self.retries:
                    raise ExpertReadError(
                        f"expert {expert} of layer {layer}: read failed after "
                        f"{n + 1} attempts: {exc}", key
                    ) from exc
                self.queue.count_retry()
            time.sleep(self.retry_backoff_s * (2**n))

    # -- on the staging threads (actors/read_finish.py) --------------------------------------

    def _check(self, key: ExpertKey, buffer: np.ndarray) -> None:
        """The crc32 check; a mismatch is read again (a flipped bit in flight), bounded."""

        def attempt(n: int) -> None:
            if n:
                self._pread(key, buffer)
            self.container.check_expert(*key, buffer)

        self._with_retries(key, attempt)

    # -- back on trio -------------------------------------------------------------------------

    def _complete(self, load: Load, buffer: np.ndarray | None, error: BaseException | None,
                  begun: float | None) -> None:
        if error is not None:
            if buffer is not None:
                self.give_back(buffer)
            load.error = error
            log.warning("reader.failed", layer=load.key[0], expert=load.key[1], error=str(error))
        else:
            load.buffer = buffer
        self.stats.record(load, self.container.manifest.layer(load.key[0]).stride, begun)
        load.done.set()

