"""A small pool of its own for one extra layer's experts (the MTP head's), read through
the engine's reader.

The head's experts are streamed as a layer's are (one aligned read per expert), but kept
apart from the model's pool, for three reasons:

- their format differs (8-bit where the model is usually 4-bit), and one pool holding two
  formats pays every variant in every slot (actors/pool/layout.py): 4-bit slots would
  cost three times as much;
- the model's pool has one request order, the router's, which `moestream replay`
  reproduces from a trace and the run-ahead's device-side slot map mirrors; drafts
  demanding in the middle of it would change both;
- a draft must not evict the model's experts (nor they the head's): each gets its share
  of the one budget (pipeline/engine_sizing.py `head_slots`).

Only the drafting sequence uses it, one forward at a time (a lock keeps it so); it has
its own slot table (LRU), so its hits and misses are counted apart (`snapshot`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import structlog
import trio

from actors.pool.eviction import ExpertKey
from actors.pool.slots import SlotCounters, SlotTable
from actors.reader import ExpertReader, ExpertReadError, Load

log = structlog.get_logger("moestream.head_pool")

Install = Callable[[list[tuple[int, Any]]], Awaitable[None]]


class HeadPool:
    def __init__(self, layer: int, num_experts: int, table: SlotTable, reader: ExpertReader,
                 install: Install, make_room: Callable[[], Awaitable[Any]]) -> None:
        """`layer`: the experts' index in the container (the head's: num_layers);
        `install`: finished blobs into this pool's storage; `make_room`: the model's
        router installs its finished reads, giving their staging buffers back (its
        prefetches may hold every one between forwards, and it installs them only at its
        next demand, which waits for this draft)."""
        self.layer, self.num_experts = layer, num_experts
        self.table, self.reader = table, reader
        self.install, self.make_room = install, make_room
        self.lock = trio.Lock()  # one demand at a time, then its `release`
        self.tick = 0
        self._pinned: list[ExpertKey] = []

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    async def demand(self, ids: Sequence[int]) -> np.ndarray:
        """Make `ids` (at most `num_slots`) resident and pinned; expert -> slot (-1: not
        asked). Pinned until `release`."""
        assert len(ids) <= self.table.num_slots, "a demand larger than the head's pool"
        self.release()
        self.tick += 1
        loads: list[Load] = []
        keys = {(self.layer, int(e)) for e in ids}  # a miss never evicts another of the demand
        for e in ids:
            key = (self.layer, int(e))
            _slot, resident = self.table.acquire(key, self.tick, pin=True, protect=keys)
            self._pinned.append(key)
            if not resident:
                loads.append(self.reader.submit(key, demand=True))
        try:
            await self._land(loads)
        except BaseException:
            await self._abandon(loads)
            raise
        slot_of = np.full(self.num_experts, -1, dtype=np.int32)
        for e in ids:
            slot = self.table.lookup((self.layer, int(e)))
            assert slot is not None
            slot_of[int(e)] = slot
        return slot_of

    async def _land(self, loads: list[Load]) -> None:
        """Wait for the reads, installing them as they land (each gives its buffer back)."""
        pending = list(loads)
        while pending:
            done = [load for load in pending if load.done.is_set()]
            if done:
                pending = [load for load in pending if not load.done.is_set()]
                await self._install(done)
                continue
            if self.reader.starved:
                await self.make_room()
                if any(load.done.is_set() for load in pending):
                    continue
            # Woken by any read finishing (ours, or the router's, freeing a buffer).
            with trio.move_on_after(0.05):
                await self.reader.wait_any()

    async def _install(self, done: list[Load]) -> None:
        failed = next((load for load in done if load.error is not None), None)
        if failed is not None:
            key = failed.key
            raise ExpertReadError(f"expert {key[1]} of the MTP head (layer {key[0]}): {failed.error}",
                                  key) from failed.error
        items = []
        for load in done:
            slot = self.table.lookup(load.key)
            assert slot is not None and load.buffer is not None
            items.append((slot, load.buffer))  # the raw blob: staged copies are the model's layout
        try:
            await self.install(items)
        finally:
            for load in done:
                assert load.buffer is not None
                self.reader.give_back(load.buffer)
                load.buffer = None
        for load in done:
            self.table.mark_ready(load.key)

    async def _abandon(self, loads: list[Load]) -> None:
        """A read failed (or the draft was cancelled): the others' buffers come back once
        they land (reads end in milliseconds; a hung disk is not waited for long), and no
        key stays "loading"."""
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            for load in loads:
                await load.done.wait()
        for load in loads:
            if load.buffer is not None:
                self.reader.give_back(load.buffer)
                load.buffer = None
            if load.key in self.table and self.table.state(load.key) == "loading":
                self.table.release(load.key)
        self._pinned = [k for k in self._pinned if k in self.table]

    def release(self) -> None:
        """Unpin the last demand's experts (their compute has been evaluated)."""
        for key in self._pinned:
            if self.table.pin_count(key):
                self.table.unpin(key)
        self._pinned.clear()

    def snapshot(self) -> SlotCounters:
        return self.table.snapshot()
