"""The router actor: turns a layer's true routing into resident pool slots.

A trio task of its own (`run`, in the engine's nursery) that takes requests from one
bounded channel, in order: demands from compute, prefetch orders from the prefetcher,
drains from a generation that ends badly, a settle when the engine goes idle. Being the
only task that touches the slot table, it keeps the pool's bookkeeping in one
well-defined order (the order `replay` reproduces) whoever asks. `demand`, `prefetch`,
`drain` and `settle` send requests; the `_`-prefixed methods are what the task runs.

It owns the slot table (through the `PoolDriver`, the same call sequence `moestream
replay` makes) and the loads in flight. For a demand it pins the layer's experts,
issues reads for the misses, promotes prefetches that are now needed, and waits for
exactly those loads; the wait is the compute stall. Finished loads, demanded or
prefetched, are handed to compute to be installed between layers, unless they landed.

Landing (actors/reader.py): a read may be installed by a staging thread when it ends only
if no MLX work queued at any time before then can read the slot it goes to. Compute sets
`landing_safe` while it steps layer by layer: then the only queued kernels are the current
layer's, which read that layer's pinned experts (every path into `Compute.layered` syncs
first, and a decode batch's queued step is parked before any other compute turn:
`DecodeBatch.exclusive`), and a slot taken now (its key evicted:
never a pinned one) is read by nothing queued; later kernels are queued only after the
key is marked ready, by which time its bytes are in place. A run-ahead's kernels read any
ready expert through the slot map, so slots taken while one may be queued are installed
the synchronized way; and since a CPU install is a memcpy that MLX's stream does not
order, a step's bookkeeping checks that every expert its map gave it is still in that slot
(`SlotMap.held`), else the layer counts as a miss and is redone. A landing read whose key is evicted before it lands is abandoned
(under the reader's landing lock for its slot) and set aside until it ends, so its buffer comes back;
the key, if demanded again, gets a read of its own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import outcome
import structlog
import trio

from actors import timeline
from actors.inbox import Inbox
from actors.pool.driver import PoolDriver
from actors.pool.eviction import ExpertKey
from actors.pool.slots import SlotTable
from actors.reader import ExpertReader, ExpertReadError, Load
from actors.router_types import Install, PullStarved, RouterStats
from actors.shelf import Shelf

log = structlog.get_logger("moestream.router")

class ExpertRouter:
    def __init__(
        self,
        table: SlotTable,
        reader: ExpertReader,
        num_experts: int,
        install: Callable[[list[Install]], Awaitable[None]],
    ) -> None:
        self.table = table
        self.install = install
        self.driver = PoolDriver(table)
        self.reader = reader
        self.num_experts = num_experts
        self.loads: dict[ExpertKey, Load] = {}
        self.failures: dict[ExpertKey, BaseException] = {}
        self.stats = RouterStats()
        # Reads land in milliseconds; a disk that hangs must not hold a finished
        # generation's end longer than this (the next demand collects what is left).
        self.settle_timeout_s = 2.0
        # Reads may be installed where they land (compute sets it; see the module docstring).
        self.landing_safe = False
        # The MLX thread is running a token that waits on the GPU for this router's answers
        # (actors/device_wait.py): an install then only becomes copies (`pull`: (device
        # address, host address, bytes) per tensor) handed with their staging buffers to
        # `pulled` (the compute lists them for the GPU, which makes them before any kernel
        # reads the slots, and gives the buffers back after); nothing here makes a CUDA
        # call the token could block. Installs then go as each read ends (they stream).
        self.mlx_busy = False
        self.pull: Callable[[list[Install]], list[tuple[int, int, int]]] | None = None
        self.pulled: Callable[[list[tuple[int, int, int]], list[np.ndarray]], None] | None = None
        self.copy_now: Callable[[list[tuple[int, int, int]]], Awaitable[None]] | None = None  # MLX idle
        # Landing reads whose key was evicted first: kept until they end (their buffers).
        self.orphans: list[Load] = []
        self.shelf = Shelf(reader)  # stale predictions off the queue (actors/shelf.py)
        # A demand's predictions, placed once its reply is sent (`_complete`: no wait).
        self._after_reply: tuple[Sequence[tuple[int, Sequence[int]]], int] | None = None
        table.on_evict = self._evicted
        reader.on_done = self._read_done
        self._pull_asked = False  # a `_pull_now` request is in the channel
        # Bounded: a sender waits while the router is busy (compute waits anyway).
        self._inbox = Inbox("router", 16)

    # -- the task ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve requests until the engine's nursery is cancelled."""
        await self._inbox.serve(self._after_each)

    async def _after_each(self) -> None:
        if self._after_reply is not None:  # a prefetch no wait needed first
            predictions, tick = self._after_reply
            self._after_reply = None
            # The asker runs first: a GPU waiting for this answer (actors/awaited.py) goes
            # on while the placement is made; no request comes in between.
            await trio.sleep(0)
            with timeline.span("router", "prefetch-after-reply"):
                await outcome.acapture(self._prefetch, predictions, tick)  # as `prefetch`'s: dropped

    # -- requests --------------------------------------------------------------------------

    async def demand(self, layer: int, ids: Sequence[int], tick: int,
                     then_prefetch: Sequence[tuple[int, Sequence[int]]] | None = None) -> np.ndarray:
        """Make `ids` of `layer` resident and installed; returns slot_of (expert -> slot).

        `then_prefetch`: the predictions made with this layer's routing, ordered right
        after its demand is placed and before its reads are waited for, so the disk
        starts on the next layers while this one's last reads land. The slot table sees
        the same calls in the same order as a separate `prefetch` after the demand."""
        return await self._inbox.ask(self._demand, layer, list(ids), tick, then_prefetch)

    async def demand_all(self, items: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """`demand` for several (layer, ids, tick) in order, as one request: the
        bookkeeping of a token that ran ahead with every expert present."""
        await self._inbox.ask(self._demand_all, [(layer, list(ids), tick) for layer, ids, tick in items])

    async def _demand_all(self, items: list[tuple[int, list[int], int]]) -> None:
        # A token that ran ahead found every expert ready: each layer's pool calls are
        # made (the same sequence as `demand`'s), and the wait and the slot map are
        # skipped while every key is still ready (a decode token's 40 layers: the host
        # work between two pipelined steps). A key that is not goes the whole way.
        for layer, ids, tick in items:
            self.shelf.stale(self.loads, layer, ids)
            placed = self.driver.demand(layer, ids, tick)  # a key not resident is now loading
            if not all(self.table.ready((layer, int(e))) for e in ids):
                await self._complete(layer, ids, tick, placed)
        await self.install_finished()  # what the prefetches read meanwhile, once a token

    async def prefetch(self, predictions: Sequence[tuple[int, Sequence[int]]], tick: int) -> None:
        """Queue predicted experts for reading (no reply: ordered before later demands)."""
        if predictions:
            await self._inbox.tell(self._prefetch, predictions, tick)

    async def install_now(self) -> None:
        """Install every finished read now: the MTP head's pool (actors/pool/head_pool.py)
        needs their staging buffers between the model's forwards."""
        await self._inbox.ask(self.install_finished)

    async def drain(self) -> None:
        """Wait for every read in flight and drop its result (cancellation, shutdown)."""
        await self._inbox.ask(self._drain)

    async def settle(self) -> None:
        """The engine went idle: finish the reads the last prefetch orders started and
        install them, so no staging buffer is held and no slot stays "loading" between
        requests (the next request finds those experts ready). Reads still out after
        `settle_timeout_s` (a hung disk) stay for the next demand to collect."""
        await self._inbox.ask(self._settle)

    # -- what the task runs ----------------------------------------------------------------

    async def _demand(self, layer: int, ids: Sequence[int], tick: int,
                      then_prefetch: Sequence[tuple[int, Sequence[int]]] | None = None) -> np.ndarray:
        """Make `ids` of `layer` resident and installed; returns slot_of (expert -> slot)."""
        self.shelf.stale(self.loads, layer, ids)  # before the placement, as `_demand_all` does
        return await self._complete(layer, ids, tick, self.driver.demand(layer, ids, tick),
                                    then_prefetch)

    async def _complete(self, layer: int, ids: Sequence[int], tick: int,
                        placed: list[tuple[int, bool]],
                        then_prefetch: Sequence[tuple[int, Sequence[int]]] | None = None) -> np.ndarray:
        """A placed demand (`driver.demand`'s answer): its reads issued and waited for."""
        self.failures.clear()  # only this demand's failures are reported
        waits: list[Load] = []
        misses: dict[ExpertKey, int] = {}  # key -> its slot, read together below
        for expert, (taken, was_resident) in zip(ids, placed, strict=True):
            key = (layer, int(expert))
            load = self.loads.get(key)
            if load is None and not was_resident:
                misses[key] = taken
            elif load is not None:
                if not load.demand:
                    self.stats.prefetch_hits_waited += 1
                self.shelf.taken(load)
                self.reader.promote(load)
                waits.append(load)
        if misses:  # under one lock and one wake-up; they start before the placement below
            for load in self.reader.submit_many(list(misses.items()), demand=True, land=self.landing_safe):
                self.loads[load.key] = load
                waits.append(load)
            self.reader.hand_over()
        if then_prefetch:
            if waits:  # placed before the wait: the disk starts on the next layers meanwhile
                await self._prefetch(then_prefetch, tick)
            else:  # nothing to wait for: placed right after the reply (the same calls in the
                self._after_reply = (then_prefetch, tick)  # same order; the asker goes on)
        start = time.perf_counter()
        # Install in batches (each install is one MLX call with a fixed cost): once
        # every demanded load has landed, or earlier when the readers run out of
        # staging buffers, so staging memory stays bounded whatever a layer misses.
        with timeline.span("router", "stall", layer=layer, misses=len(waits)):
            while True:
                all_done = all(load.done.is_set() for load in waits)
                if all_done or self.reader.starved or self.mlx_busy:
                    installed = await self.install_finished()
                    if self.mlx_busy and self.reader.starved and any(not load.started for load in waits):
                        # Pulled installs keep their buffers until the GPU's wait that lists
                        # them has ended, which needs this demand's answer: the token gives up.
                        raise PullStarved(f"layer {layer}: every staging buffer is held by a pulled install")
                    if all_done:
                        break
                    if installed:
                        continue
                # Loads may have landed during the install's await: only sleep if none did.
                if not all(load.done.is_set() for load in waits):
                    await self.reader.wait_any()
        elapsed = time.perf_counter() - start
        self.stats.stall_seconds += elapsed
        if waits and elapsed > 0:
            last = max(waits, key=lambda load: load.t_done)
            if last.predicted:
                self.stats.stall_late_seconds += elapsed
            else:
                self.stats.stall_unpredicted_seconds += elapsed
            timeline.instant("router", "stall-cause", layer=layer, ms=round(elapsed * 1000, 3),
                             cause="predicted, late" if last.predicted else "not predicted")
        slot_of = np.full(self.num_experts, -1, dtype=np.int32)
        for expert in ids:
            slot = self.table.lookup((layer, int(expert)))
            if slot is None or self.table.state((layer, int(expert))) != "ready":
                # The read's own error is the cause: it says what kind of damage it was.
                failure = self.failures.pop((layer, int(expert)), None)
                raise ExpertReadError(str(failure) if failure is not None else
                                      f"expert {expert} of layer {layer} could not be loaded",
                                      (layer, int(expert))) from failure
            slot_of[int(expert)] = slot
        return slot_of

    def _read_done(self) -> None:
        """Reads ended (the reader's hook, on the trio thread). While a token waits on the
        GPU, this task lists its copies now, for the layer the GPU waits on next: left to
        the next demand, they were listed after that layer was published, and the GPU made
        them behind the host's answer, in series with the layer (session 26)."""
        if self.mlx_busy and not self._pull_asked:
            # Where the channel is full, the next demand collects them.
            self._pull_asked = self._inbox.try_tell(self._pull_now)

    async def _pull_now(self) -> None:
        self._pull_asked = False
        if self.mlx_busy:  # else the token ended: the next demand installs them
            pulled = self.stats.pulled
            await self.install_finished(errors=False)
            self.stats.pulled_early += self.stats.pulled - pulled

    async def install_finished(self, errors: bool = True) -> int:
        """Copy every finished load into its slot (on the MLX thread) and mark it ready.
        `errors=False`: a failed load stays for its demand to report."""
        installs, keys, buffers, landed = self.collect(errors)
        for key in landed:
            self.table.mark_ready(key)
        if not installs:
            return len(landed)
        if self.mlx_busy:  # ready now: the bytes arrive before any kernel can read them
            assert self.pull is not None and self.pulled is not None, "a token waits without pulled installs"
            self.pulled(self.pull(installs), buffers)
            self.stats.pulled += len(installs)
            for key in keys:
                self.table.mark_ready(key)
            return len(installs) + len(landed)
        try:
            with timeline.span("router", "install", experts=len(installs)):
                await self.install(installs)
        except BaseException:
            for key in keys:
                if key in self.table and self.table.pin_count(key) == 0:
                    self.table.release(key)
            raise
        finally:
            for buffer in buffers:
                self.reader.give_back(buffer)
        for key in keys:
            if key in self.table:
                self.table.mark_ready(key)
        return len(installs) + len(landed)

    async def _prefetch(self, predictions: Sequence[tuple[int, Sequence[int]]], tick: int) -> None:
        self.shelf.predicted(self.loads, predictions)  # the table kept their slots
        reads = [(key, slot) for key, slot in self.driver.prefetch(predictions, tick)
                 if key not in self.loads]
        if reads:
            for load in self.reader.submit_many(reads, demand=False, land=self.landing_safe):
                self.loads[load.key] = load
            self.reader.hand_over()

    def _evicted(self, key: ExpertKey) -> None:
        """The slot table dropped `key`: a read landing for it must not write that slot."""
        load = self.loads.get(key)
        if load is not None and load.shelved:  # never started: nothing to land or free
            del self.loads[key]
            self.shelf.taken(load)
            self.stats.shelved_dropped += 1
            return
        if load is None or not load.land:
            return
        with self.reader.landing_lock(load.slot):
            load.abandoned = True
        self.stats.landings_abandoned += 1
        del self.loads[key]
        self.orphans.append(load)

    def _collect_orphans(self) -> None:
        for load in [o for o in self.orphans if o.done.is_set()]:
            self.orphans.remove(load)
            if load.buffer is not None:
                self.reader.give_back(load.buffer)

    def collect(self, errors: bool = True) -> tuple[list[Install], list[ExpertKey], list[np.ndarray], list[ExpertKey]]:
        """Finished loads whose key is still resident, as (slot, blob) with their keys and
        buffers; stale ones are dropped. Last, the keys of loads that landed (in their
        slots already: only to be marked ready)."""
        installs: list[Install] = []
        buffers: list[np.ndarray] = []
        keys: list[ExpertKey] = []
        landed: list[ExpertKey] = []
        self._collect_orphans()
        for key, load in list(self.loads.items()):
            if not load.done.is_set() or (load.error is not None and not errors):
                continue
            del self.loads[key]
            slot = self.table.lookup(key)
            if load.error is not None:
                self.failures[key] = load.error
                if slot is not None:
                    self.table.release(key)
                continue
            if load.landed:
                # Not abandoned, so never evicted: the key still holds the slot it landed in.
                assert slot == load.slot, (key, slot, load.slot)
                landed.append(key)
                continue
            assert load.buffer is not None
            if slot is None:
                self.reader.give_back(load.buffer)
                continue
            # The blob as the reader staged it (an MLX array) or the raw staging buffer.
            installs.append((slot, load.staged if load.staged is not None else load.buffer))
            buffers.append(load.buffer)
            keys.append(key)
        return installs, keys, buffers, landed

    async def _drain(self) -> None:
        # Loads can outnumber the staging buffers (queued predictions): each finished one
        # gives its buffer back at once, or the queued ones would never start.
        self.shelf.requeue_all(self.loads)
        while True:
            _installs, _keys, buffers, _landed = self.collect()
            for buffer in buffers:
                self.reader.give_back(buffer)
            if not self.loads and not self.orphans:
                break
            await self.reader.wait_any()
        self.driver.end_layer()
        self.release_unready()

    async def _settle(self) -> None:
        # As in `_drain`: installing as loads land frees their buffers for the queued ones.
        self.shelf.requeue_all(self.loads)
        with trio.move_on_after(self.settle_timeout_s) as waited:
            while True:
                await self.install_finished()
                if not self.loads and not self.orphans:
                    break
                # One that finished during the install's await would wake no `wait_any`: it
                # waited out the timeout (2 s at the end of a generation; session 22).
                if not any(load.done.is_set() for load in [*self.loads.values(), *self.orphans]):
                    await self.reader.wait_any()
        if waited.cancelled_caught:
            log.warning("router.settle_timed_out", in_flight=len(self.loads),
                        seconds=self.settle_timeout_s)
            await self.install_finished()
        self.driver.end_layer()
        self.release_unready()

    def release_unready(self) -> None:
        """After an abandoned forward: keys never installed must not look resident."""
        for key in self.table.resident():
            if self.table.state(key) == "loading" and key not in self.loads:
                if self.table.pin_count(key) == 0:
                    self.table.release(key)
