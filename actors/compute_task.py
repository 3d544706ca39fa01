"""The compute task: admits generations, each a job with its own cancel scope.

A generation's body (prefill, decode, bookkeeping: `pipeline/generation.py`) runs here,
in a nursery of the engine's, not in the task of whoever asked for it. The asker submits
a `Job` and reads what the job produces from a channel; when the asker goes away (client
gone, consumer cancelled) it cancels the job's scope and waits for the job to finish
cleaning up. Jobs are admitted in submission order (FIFO) while the decode batch has
room: at most `capacity` run at once, and their model state (`Job.cost` bytes) stays
within `budget`; the rest wait. Running jobs share the MLX thread turn by turn (prefill
chunks, batch steps: `actors/decode_batch.py`). When the last running job ends, however
it ended (done, failed, cancelled), and nothing waits, `on_idle` runs (the engine hands
freed host memory back then: `pipeline/heap_trim.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio


@dataclass(eq=False)
class Job:
    body: Callable[[], Awaitable[None]]
    cost: int = 0  # bytes of model state it may grow to (admission)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    abandoned: bool = False  # its asker left: skipped if still queued, else cancelled
    # Called when the job ends without its body having run (skipped, or the engine closed
    # first): the body is what ends the asker's stream otherwise (a generation's channel).
    unrun: Callable[[], object] | None = None

    def end(self) -> None:
        """Done, run or not: its asker is let go, and its body dropped. The body is the
        generation's own method (a closure over it), and the generation holds its job, so
        the two made a cycle that kept the finished generation's model state alive until
        Python's cyclic collector happened to run (seconds, or never on a quiet server)."""
        self.body = _spent
        if not self.started.is_set() and self.unrun is not None:
            self.unrun()
        self.unrun = None
        self.finished.set()


async def _spent() -> None:
    raise RuntimeError("a compute job runs once")


class ComputeTask:
    def __init__(self, capacity: int = 1, budget: int = 0,
                 on_idle: Callable[[], Awaitable[object]] | None = None) -> None:
        self.capacity = capacity
        self.budget = budget  # bytes; 0 = no limit
        self._on_idle = on_idle
        self.running: set[Job] = set()
        self._queue: deque[Job] = deque()
        self._changed = trio.Event()
        self._closed = False

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def _fits(self, job: Job) -> bool:
        if not self.running:
            return True  # alone, a job always runs (its own limits are checked before)
        if len(self.running) >= self.capacity:
            return False
        used = sum(j.cost for j in self.running)
        return not self.budget or used + job.cost <= self.budget

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    self._admit(nursery)
                    await self._changed.wait()
                    self._changed = trio.Event()
        finally:
            # The engine is closing: jobs still queued will never run; let their askers go.
            self._closed = True
            while self._queue:
                job = self._queue.popleft()
                job.error = RuntimeError("the engine closed before this generation ran")
                job.end()

    def _admit(self, nursery: trio.Nursery) -> None:
        # Its own frame: a `job` local in `run` kept the last job (its body's generation,
        # and so its model state) alive while the task waited for the next one.
        while self._queue and (self._queue[0].abandoned or self._fits(self._queue[0])):
            job = self._queue.popleft()
            if job.abandoned:
                job.end()
                continue
            self.running.add(job)
            job.started.set()
            nursery.start_soon(self._run_job, job)

    async def _run_job(self, job: Job) -> None:
        try:
            with job.scope:
                try:
                    await job.body()
                except Exception as exc:  # the asker re-raises it
                    job.error = exc
        except BaseException:
            # Not its asker's cancel (the job's scope catches that): the engine closing under
            # it. The asker must not take the cut stream for a whole one.
            if job.error is None:
                job.error = RuntimeError("the engine closed during this generation")
            raise
        finally:
            self.running.discard(job)
            job.end()
            self._changed.set()
        del job  # the idle work runs without the finished generation (its state) alive
        # After the asker was let go: idle work is in nobody's latency. A job queued
        # meanwhile (a client's next request) waits for it, at most one trim's walk.
        if self._on_idle is not None and not self.running and not self._queue:
            await self._on_idle()

    def submit(self, job: Job) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        self._queue.append(job)
        self._changed.set()

    def abandon_now(self, job: Job) -> bool:
        """Skip a job still queued; False if it already started."""
        if job.started.is_set():
            return False
        job.abandoned = True
        job.scope.cancel()
        self._changed.set()
        return True

    async def abandon(self, job: Job) -> None:
        """The asker is gone: a queued job is skipped at once; a running one is cancelled
        and waited for (its clean-up hands the pool back)."""
        if self.abandon_now(job):
            return
        job.abandoned = True
        job.scope.cancel()
        with trio.CancelScope(shield=True):
            await job.finished.wait()
