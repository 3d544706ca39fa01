"""The one thread that runs MLX.

MLX streams are thread-local (an array built on one thread cannot be evaluated on
another: "There is no Stream(cpu, 0) in current thread"), so every MLX operation of
an engine — loading the dense core, pool installs, the forward pass — runs on this
single thread. trio code awaits it like `trio.to_thread.run_sync`, but the thread is
explicit, owned by the engine, and started and stopped by `async with`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

_STOP = object()


class MlxWorker:
    def __init__(self, name: str = "moestream-mlx") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._started = False

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, deliver = job
            deliver(outcome.capture(fn))

    def start(self) -> None:
        if not self._started:
            self._thread.start()
            self._started = True

    def stop(self) -> None:
        if self._started:
            # Finish this thread's stream work before it ends: MLX tearing down a stream
            # with work in flight at interpreter exit aborts the process ("terminate
            # called without an active exception").
            import mlx.core as mx

            self.call(mx.synchronize)
            self._jobs.put(_STOP)
            self._thread.join()
            self._started = False

    async def __aenter__(self) -> MlxWorker:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Joining may wait for the job in flight; do it off the event loop.
        await trio.to_thread.run_sync(self.stop)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the MLX thread from a plain (non-trio) thread and wait for it."""
        if threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        self._jobs.put((fn, deliver))
        done.wait()
        return box[0].unwrap()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread; the caller's trio task waits without blocking.

        Not cancellable once started: an MLX evaluation cannot be interrupted, and
        abandoning it would leave the thread's state (caches, pool) half-updated.
        """
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            token.run_sync_soon(trio.lowlevel.reschedule, task)

        self._jobs.put((lambda: fn(*args), deliver))
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return box[0].unwrap()
