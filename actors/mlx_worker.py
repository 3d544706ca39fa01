"""The one thread that runs MLX.

MLX streams are thread-local (an array built on one thread cannot be evaluated on
another: "There is no Stream(cpu, 0) in current thread"), so every MLX operation of
an engine — loading the dense core, pool installs, the forward pass — runs on this
single thread. trio code awaits it like `trio.to_thread.run_sync`.

There is one such thread per process (`MlxWorker.shared()`), started on first use and
never stopped: each new thread that touches MLX gets streams of its own (on CUDA a
stream, its worker thread and its caches, never freed), and a thread that exits tears
its streams down, which at times aborted the process ("terminate called without an
active exception"). Engines opened one after another reuse it.

The readers' device staging (`device_staging`) also touches MLX, off the MLX thread:
it runs on `MlxWorker.staging(i)`, a fixed set of threads that are likewise never
stopped, so the process's MLX streams stay bounded however long it serves. Never from
trio's worker threads, which come and go.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


class MlxWorker:
    _shared: MlxWorker | None = None
    _staging: dict[int, MlxWorker] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> MlxWorker:
        """The process's MLX thread, started on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
                cls._shared.start()
            return cls._shared

    @classmethod
    def staging(cls, index: int) -> MlxWorker:
        """The process's staging thread number `index`, started on first use."""
        with cls._shared_lock:
            worker = cls._staging.get(index)
            if worker is None:
                worker = cls._staging[index] = cls(f"moestream-stage-{index}")
                worker.start()
            return worker

    def __init__(self, name: str = "moestream-mlx") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._started = False

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            fn, deliver = job
            deliver(outcome.capture(fn))
            # Drop the job now: it may hold an engine's model or pool alive until the next.
            del job, fn, deliver

    def start(self) -> None:
        if not self._started:
            self._thread.start()
            self._started = True

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue `fn()` on this thread and return at once: `fn` reports its own result
        (the readers' staging threads hand finished loads to trio themselves)."""
        self._jobs.put((fn, _ignore))

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
        abandoning it would leave the thread's state (caches, pool) half-updated. But a
        cancel that is already pending is delivered before the job starts: the wait
        below is no checkpoint, so a loop of `run` calls whose experts never miss (no
        other await) would otherwise decode on after its caller was cancelled.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            token.run_sync_soon(trio.lowlevel.reschedule, task)

        self._jobs.put((lambda: fn(*args), deliver))
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return box[0].unwrap()


def _ignore(result: outcome.Outcome[object]) -> None:
    """A submitted job's outcome: it handled its own errors."""
