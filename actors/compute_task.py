"""The compute task: runs generations one at a time, each as a job with its own cancel scope.

A generation's body (prefill, decode, bookkeeping: `pipeline/generation.py`) runs here,
in the engine's nursery, not in the task of whoever asked for it. The asker submits a
`Job` and reads what the job produces from a channel; when the asker goes away (client
gone, consumer cancelled) it cancels the job's scope and waits for the job to finish
cleaning up, so the next job starts on a clean pool. Jobs run in submission order (FIFO),
one at a time: they share the pool, whose slots are the scarce resource.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio


@dataclass
class Job:
    body: Callable[[], Awaitable[None]]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    abandoned: bool = False  # left before its turn: skipped, never started


class ComputeTask:
    def __init__(self, lock: trio.Lock, queue_size: int = 1024) -> None:
        # The engine's lock: held while a job runs, so direct users of the compute actor
        # (tests, `Engine.warm`) never overlap a generation.
        self.lock = lock
        self._send, self._receive = trio.open_memory_channel[Job](queue_size)

    async def run(self) -> None:
        try:
            async with self._receive:
                async for job in self._receive:
                    if job.abandoned:
                        job.finished.set()
                        continue
                    try:
                        async with self.lock:
                            job.started.set()
                            with job.scope:
                                try:
                                    await job.body()
                                except Exception as exc:  # the asker re-raises it
                                    job.error = exc
                    finally:
                        job.finished.set()
        finally:
            # The engine is closing: jobs still queued will never run; let their askers go.
            while True:
                try:
                    job = self._receive.receive_nowait()
                except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                    break
                job.error = RuntimeError("the engine closed before this generation ran")
                job.finished.set()

    async def submit(self, job: Job) -> None:
        await self._send.send(job)

    @staticmethod
    async def abandon(job: Job) -> None:
        """The asker is gone: a queued job is skipped at once; a running one is cancelled
        and waited for (its clean-up hands the pool back)."""
        job.scope.cancel()
        if not job.started.is_set():
            job.abandoned = True
            return
        with trio.CancelScope(shield=True):
            await job.finished.wait()
