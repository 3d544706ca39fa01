"""The reader actor: expert reads from the container into staging buffers.

Several worker tasks (the configured concurrency) each run one blocking `preadv` at a
time in a trio worker thread. Demand reads always start before prefetch reads; a
prefetch that becomes a demand before it starts is promoted to the demand queue, and
one that is already running is simply waited on (never issued twice). A read that
fails is retried a bounded number of times, then reported on its `Load`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import trio

from actors import timeline
from actors.mlx_worker import MlxWorker
from actors.pool.eviction import ExpertKey
from qpack.reader import Container, aligned_empty

log = structlog.get_logger("moestream.reader")


class ExpertReadError(RuntimeError):
    """An expert could not be read after the configured retries; `key` is (layer, expert)
    and the failed attempt's error is the `__cause__` (what kind of damage it was)."""

    def __init__(self, message: str, key: ExpertKey | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(eq=False)
class Load:
    key: ExpertKey
    demand: bool
    done: trio.Event = field(default_factory=trio.Event)
    buffer: np.ndarray | None = None
    staged: Any = None  # what `stage` made of the buffer, on the worker's staging thread
    error: BaseException | None = None
    started: bool = False
    seconds: float = 0.0


@dataclass
class ReaderStats:
    reads: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    bytes_read: int = 0
    retries: int = 0
    failures: int = 0
    read_seconds: float = 0.0


class ExpertReader:
    def __init__(
        self,
        container: Container,
        *,
        concurrency: int,
        retries: int = 2,
        retry_backoff_s: float = 0.01,
        buffers: int | None = None,
        stage: Callable[[np.ndarray], Any] | None = None,
    ) -> None:
        # Run on each finished read off the MLX thread: the host->device copy of the blob
        # (0.6 ms per 1.7 MiB expert on the H200). Worker i stages on
        # `MlxWorker.staging(i)`: threads that touch MLX must live as long as the process.
        self.stage = stage
        self.container = container
        self.concurrency = concurrency
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        stride = container.manifest.max_stride
        # Enough staging for installs to come in batches while reads continue.
        count = buffers if buffers is not None else max(4 * concurrency, 16)
        # Page-aligned, so the same buffers serve O_DIRECT reads.
        self._free: list[np.ndarray] = [aligned_empty(stride) for _ in range(count)]
        self._free_count = trio.Semaphore(count)
        self._demand: deque[Load] = deque()
        self._prefetch: deque[Load] = deque()
        self._queued = trio.Semaphore(0)
        self._any_done = trio.Event()
        self.stats = ReaderStats()

    @property
    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self._free)

    async def run(self) -> None:
        """The actor's body: `concurrency` read workers, until cancelled."""
        async with trio.open_nursery() as nursery:
            for i in range(self.concurrency):
                nursery.start_soon(self._worker, i)

    def submit(self, key: ExpertKey, *, demand: bool) -> Load:
        load = Load(key, demand)
        (self._demand if demand else self._prefetch).append(load)
        self._queued.release()
        return load

    def promote(self, load: Load) -> None:
        """A queued prefetch is now needed: move it to the front of the line."""
        if load.demand or load.started or load.done.is_set():
            load.demand = True
            return
        load.demand = True
        self._prefetch.remove(load)
        self._demand.append(load)

    @property
    def starved(self) -> bool:
        """Every staging buffer holds a finished blob or a read: installs must free some."""
        return self._free_count.value == 0

    async def wait_any(self) -> None:
        """Until the next load finishes (whichever it is)."""
        await self._any_done.wait()

    def give_back(self, buffer: np.ndarray) -> None:
        self._free.append(buffer)
        self._free_count.release()

    def _next(self) -> Load:
        load = self._demand.popleft() if self._demand else self._prefetch.popleft()
        # Off the queue now: a promotion from here on must not look for it there.
        load.started = True
        return load

    async def _worker(self, index: int = 0) -> None:
        while True:
            await self._queued.acquire()
            load = self._next()
            await self._free_count.acquire()
            buffer = self._free.pop()
            start = time.perf_counter()
            try:
                with timeline.span(f"reader-{index}", "read" if load.demand else "prefetch",
                                   layer=load.key[0], expert=load.key[1]):
                    await trio.to_thread.run_sync(self._read, load.key, buffer)
                    if self.stage is not None:
                        load.staged = await MlxWorker.staging(index).run(self.stage, buffer)
            except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the load
                self.give_back(buffer)
                load.error = exc
                self.stats.failures += 1
                log.warning("reader.failed", layer=load.key[0], expert=load.key[1], error=str(exc))
            else:
                load.buffer = buffer
                nbytes = self.container.manifest.layer(load.key[0]).stride
                self.stats.reads += 1
                self.stats.bytes_read += nbytes
                if load.demand:
                    self.stats.demand_reads += 1
                else:
                    self.stats.prefetch_reads += 1
            load.seconds = time.perf_counter() - start
            self.stats.read_seconds += load.seconds
            load.done.set()
            self._any_done.set()
            self._any_done = trio.Event()

    def _read(self, key: ExpertKey, buffer: np.ndarray) -> None:
        """Blocking, in a worker thread: one read, retried on failure with a short backoff."""
        layer, expert = key
        for attempt in range(self.retries + 1):
            try:
                self.container.read_expert(layer, expert, buffer)
                return
            except Exception as exc:
                if attempt == self.retries:
                    raise ExpertReadError(
                        f"expert {expert} of layer {layer}: read failed after "
                        f"{attempt + 1} attempts: {exc}", key
                    ) from exc
                self.stats.retries += 1
                time.sleep(self.retry_backoff_s * (2**attempt))
