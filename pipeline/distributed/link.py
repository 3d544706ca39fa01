"""A rank's link to the others: one thread that runs every mlx.distributed operation.

Why a thread of its own, not the MLX thread: a blocking `recv` cannot be interrupted, so
a peer that stops answering would freeze whatever thread waits in it. Here the waiting
side (the MLX thread in the middle of a forward, or a trio task) waits on this thread
with a deadline instead, and gives up cleanly when it passes: the link is then marked
broken (the stuck thread is a daemon and is abandoned) and every later call fails at
once with `RankLost`. A peer that dies shows up sooner: the ring backend fails a send
or recv with "connection to a peer was lost" as soon as the socket closes.

Data crosses as numpy arrays of raw bits (float32 as uint32, bfloat16 as uint16): MLX
arrays are tied to the thread whose stream built them, and numpy has no bfloat16. All
operations use the CPU stream: the ring backend moves host memory.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
import trio

from pipeline.distributed.doorbell import Doorbell
from pipeline.distributed.errors import DistributedSetupError, RankLost

log = structlog.get_logger("moestream.distributed")

T = TypeVar("T")


class Link:
    """This process's group (`mx.distributed.init`) and the thread that talks to it."""

    def __init__(self) -> None:
        """The thread only; `join` makes the group (tests drive the thread alone)."""
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="moestream-link", daemon=True)
        self._thread.start()
        self.broken: str | None = None
        self.on_broken: Callable[[], None] | None = None  # told once, when the link breaks
        self.seconds = 0.0  # wall time spent in calls (the boundary's cost, with the wait)
        self.group: Any = None
        self.rank, self.size = 0, 1
        self.doorbell = Doorbell([])

    @classmethod
    def join(cls, backend: str) -> Link:
        """This process's link, joined to the job `mlx.launch` started."""
        link = cls()
        link.group = link.call(lambda: _init(backend), timeout=None, what="init")
        link.rank, link.size = link.group.rank(), link.group.size()
        if link.size > 1 and backend == "ring":
            link.doorbell = Doorbell.for_rank(link.rank)  # receives wait here, not spinning
        return link

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()
            del fn, box, done

    def call(self, fn: Callable[[], T], timeout: float | None, what: str) -> T:
        """Run `fn` on the link thread from any other thread; `RankLost` if it fails on a
        lost connection or takes longer than `timeout` seconds."""
        if self.broken is not None:
            raise RankLost(self.broken)
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        start = time.perf_counter()
        self._jobs.put((fn, box, done))
        finished = done.wait(timeout)
        self.seconds += time.perf_counter() - start
        if not finished:
            raise self._break(f"no answer from the other ranks within {timeout:g} s ({what}); "
                              "a rank hung or the network is down")
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, RuntimeError):
            # The ring backend's words for a closed socket; anything else failing in a
            # distributed op leaves the ranks out of step just the same.
            raise self._break(f"a rank was lost ({what}): {value}") from value
        raise value

    def _break(self, reason: str) -> RankLost:
        if self.broken is None:
            self.broken = reason
            log.error("distributed.rank_lost", rank=getattr(self, "rank", None), reason=reason)
            if self.on_broken is not None:
                self.on_broken()
        return RankLost(reason)

    async def run(self, fn: Callable[[], T], timeout: float | None, what: str) -> T:
        """`call` from trio; a cancel abandons the wait (the link is then unusable)."""
        try:
            return await trio.to_thread.run_sync(self.call, fn, timeout, what,
                                                 abandon_on_cancel=True)
        except trio.Cancelled:
            if self.broken is None:
                self._break(f"cancelled while waiting on the other ranks ({what})")
            raise


def _init(backend: str) -> Any:
    import mlx.core as mx

    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:  # not a lost rank: this process was started wrong
        raise DistributedSetupError(
            f"cannot join the distributed job ({backend} backend): {exc}; start every rank "
            "with `mlx.launch` (docs/distributed.md)") from None
