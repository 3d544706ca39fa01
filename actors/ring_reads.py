"""The reader's disk work through one io_uring (`reader.io = "uring"`), in place of threads.

With threads, each read returns into Python on its own thread, which takes the GIL back
before it can hand the blob on or start the next read; the more threads, the more of
those hand-overs queue behind the event loop and the MLX thread (on the H200's page cache
a read that copies in ~0.25 ms took ~0.45, and 4-8 threads were no faster than 2:
docs/results.md, sixteenth pass). Here one thread keeps every read the queues allow in
flight on the kernel's workers (qpack/uring.py) and, each time it returns, hands on every
read that ended meanwhile: one GIL acquisition for a batch.

What stays as with threads (actors/reader.py): the queues, demand first, taken under the
reader's lock (`ReadQueue.take_many`: the threads' lanes become capacities), the
staging buffers, predictions yielding to demand reads, what happens after a read
(`after_reads`: staging threads, landing, checksums, trio). A read that fails or comes
back short is read again the threads' way (`ExpertReader.read`, with its bounded retries
and its error), on this thread. The ring's thread blocks in the kernel, not on the
reader's condition, so every queue change writes an eventfd the ring keeps a read on.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Protocol

import numpy as np
import structlog
import trio

from actors import timeline
from actors.disk_meter import DiskMeter
from actors.pool.eviction import ExpertKey
from actors.read_finish import Done
from actors.read_load import Load
from actors.read_queue import ReadQueue
from qpack.reader import Container
from qpack.uring import Ring

log = structlog.get_logger("moestream.reader")
_WAKE = 0  # the eventfd read's tag; reads count up from 1
_ORPHANED: list[np.ndarray] = []  # buffers of reads a failed ring may still write into


def _ring(entries: int) -> Ring | None:
    """A ring of `entries`, or None (logged: the reader keeps its threads)."""
    try:
        return Ring(entries)
    except OSError as exc:
        log.warning("reader.uring_unavailable", error=str(exc), fallback="threads")
        return None


class ExpertReaderLike(Protocol):
    """What the ring uses of actors/reader.py's ExpertReader (which imports this module)."""

    container: Container
    concurrency: int
    demand_lane: int
    bulk_lane: int
    meter: DiskMeter
    queue: ReadQueue

    def read(self, key: ExpertKey, buffer: np.ndarray) -> None: ...
    def after_reads(self, token: trio.lowlevel.TrioToken, ended: list[Done]) -> None: ...
    def fall_back(self, token: trio.lowlevel.TrioToken, lost: list[Load]) -> None: ...


class RingReads:
    def __init__(self, reader: ExpertReaderLike, ring: Ring, wake_fd: int) -> None:
        self.reader = reader
        self.ring = ring
        self.wake_fd = wake_fd
        self._word = np.zeros(1, dtype=np.uint64)  # where the eventfd's count is read to
        # A wake after the ring closed must not write to the fd number's next owner.
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def usable(container: Container) -> bool:
        """Whether a ring can read `container` here (logged where not): io_uring present
        and allowed, and reads not routed through the container's own `ExpertIO`."""
        if not container.plain_io:
            log.info("reader.uring_declined", reason="the container reads through its own io")
            return False
        ring = _ring(2)
        if ring is None:
            return False
        # A read, not only the set-up: kernels before 5.6 set a ring up and then fail every
        # IORING_OP_READ with EINVAL (each read would fall back, one at a time).
        probe = np.zeros(16, dtype=np.uint8)
        fd = os.open(container.root / "manifest.json", os.O_RDONLY | os.O_CLOEXEC)
        try:
            ring.read(fd, probe.ctypes.data, probe.nbytes, 0, 1)
            ring.enter(1)
            res = dict(ring.reap()).get(1, -errno.EIO)
        except OSError as exc:
            res = -(exc.errno or errno.EIO)
        finally:
            os.close(fd)
            ring.close()
        if res < 0:
            log.info("reader.uring_declined", reason=f"a read through the ring failed: {os.strerror(-res)}")
            return False
        return True

    @classmethod
    def open(cls, reader: ExpertReaderLike) -> RingReads | None:
        """A ring for `reader`, or None (logged) where the kernel refuses it now."""
        ring = _ring(2 * (reader.concurrency + reader.demand_lane + reader.bulk_lane + 1))
        return None if ring is None else cls(reader, ring, os.eventfd(0, os.EFD_CLOEXEC))

    def wake(self) -> None:
        """From any thread: the queues changed, take what may start."""
        with self._lock:
            if not self._closed:
                os.eventfd_write(self.wake_fd, 1)

    def _arm(self) -> None:
        self.ring.read(self.wake_fd, self._word.ctypes.data, 8, 0, _WAKE, on_workers=False)

    def run(self, token: trio.lowlevel.TrioToken) -> None:
        """The ring's thread: until the reader closes, then until its reads have ended.
        Where the ring itself fails, the reads it held go to disk threads instead."""
        flying: dict[int, tuple[Load, np.ndarray, int]] = {}
        failed = False
        try:
            self._serve(token, flying)
        except OSError as exc:  # the ring itself failed: nothing a read's retries can mend
            log.error("reader.uring_failed", error=str(exc), in_flight=len(flying), fallback="threads")
            failed = True
        finally:
            try:
                if failed:
                    self._give_up(token, flying)
                else:
                    self._wait_out(flying)
            finally:
                with self._lock:
                    self._closed = True
                    for close in (self.ring.close, lambda: os.close(self.wake_fd)):
                        try:
                            close()
                        except OSError as exc:  # a failed ring may refuse its own close
                            log.warning("reader.uring_close_failed", error=str(exc))
        if failed:
            self.reader.fall_back(token, [load for load, _buffer, _need in flying.values()])

    def _serve(self, token: trio.lowlevel.TrioToken, flying: dict[int, tuple[Load, np.ndarray, int]]) -> None:
        reader, ring = self.reader, self.ring
        tag = _WAKE
        self._arm()
        while (taken := reader.queue.take_many(len(flying))) is not None:
            ended: list[Done] = []
            for load, buffer in taken:
                tag += 1
                load.t_start = time.perf_counter()
                reader.meter.begin()
                try:  # opens the layer's file the first time: its error is this read's
                    fd, offset, want, need = reader.container.expert_extent(*load.key, buffer.nbytes)
                except OSError:
                    ended.append(self._ended(load, buffer, 1, -errno.EIO))  # the threads' way
                    continue
                flying[tag] = (load, buffer, need)
                ring.read(fd, buffer.ctypes.data, want, offset, tag)
            try:
                ring.enter(1)
                for done, res in ring.reap():
                    if done == _WAKE:
                        self._arm()
                        continue
                    ended.append(self._ended(*flying.pop(done), res))
            finally:  # even where the ring failed: these reads have ended
                if ended:
                    reader.after_reads(token, ended)

    def _wait_out(self, flying: dict[int, tuple[Load, np.ndarray, int]]) -> None:
        """Closing: the kernel still writes into the buffers of reads in flight, so wait
        them out and give their buffers back (a reader run again finds them all)."""
        try:
            while flying:
                self.ring.enter(1)
                for done, _ in self.ring.reap():
                    ended_read = flying.pop(done, None)
                    if ended_read is not None:
                        self.reader.meter.end()
                        self.reader.queue.give_back(ended_read[1])
        except OSError:
            self._give_up(None, flying)

    def _give_up(self, token: trio.lowlevel.TrioToken | None,
                 flying: dict[int, tuple[Load, np.ndarray, int]]) -> None:
        """The ring cannot be waited on. Reads it completed are answered (given a token);
        the others' buffers (and the wake-up's word) may still be written, so they outlive
        this thread, kept for the process's life and never reused; `flying` keeps their loads."""
        ended: list[Done] = []
        for done, res in self.ring.reap():
            read = flying.pop(done, None)
            if read is None:
                continue
            if token is None:  # closing: nobody waits for it
                self.reader.meter.end()
                self.reader.queue.give_back(read[1])
            else:
                ended.append(self._ended(*read, res))
        if ended:
            assert token is not None
            self.reader.after_reads(token, ended)
        for _load, buffer, _need in flying.values():
            self.reader.meter.end()
            _ORPHANED.append(buffer)
        _ORPHANED.append(self._word)

    def _ended(self, load: Load, buffer: np.ndarray, need: int, res: int) -> Done:
        reader = self.reader
        reader.meter.end()
        error: BaseException | None = None
        if res < need:  # an I/O error or a short read: again the threads' way, bounded
            try:
                reader.read(load.key, buffer)
            except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the load
                error = exc
        tl = timeline.active()
        if tl is not None:
            start = (load.t_start * 1e9 - tl.t0) / 1000.0
            tl.add("reader-ring", "read" if load.demand else "prefetch", start,
                   tl.now_us() - start, {"layer": load.key[0], "expert": load.key[1]})
        return load, buffer, error
