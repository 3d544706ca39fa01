"""Slot bookkeeping for the expert pool: which expert lives in which slot.

The table holds no weights; the pool that owns the buffers asks it where an expert goes
and what to evict. It never maps more than `num_slots` keys, never evicts a pinned key,
and keeps the key -> slot map a bijection onto the used slots. Free slots are handed out
lowest index first so that a replay assigns the same slots as the live run. With banks
(actors/pool/banks.py) a key takes a slot only in its layer's bank: free there, else the
policy's victim among that bank's keys.

States: a key acquired on a miss is "loading" until the reader calls `mark_ready`; a load
that failed gives its slot back with `release`. A resident key counts as a hit whether it
is loading or ready: it is in the pool, and any wait for it is measured live as stall.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container
from typing import Literal

import msgspec

from actors.pool.banks import Banks
from actors.pool.eviction import EvictionPolicy, ExpertKey

SlotState = Literal["loading", "ready"]


class PoolExhausted(RuntimeError):
    """No slot can be freed: every resident key is pinned (or protected)."""


class SlotCounters(msgspec.Struct, frozen=True):
    num_slots: int
    resident: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    prefetch_installs: int
    prefetch_used: int
    prefetch_wasted: int
    prefetch_dropped: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SlotTable:
    def __init__(self, num_slots: int, policy: EvictionPolicy, keys: int | None = None,
                 banks: Banks | None = None) -> None:
        """`keys`: how many distinct keys exist (the model's routed experts), when known.
        While every one of them fits the usable slots nothing is ever evicted, so a hit
        does not teach the policy (its bookkeeping was most of a token's host work with
        every expert pooled); it learns again once slots are withdrawn below that."""
        if num_slots < 1:
            raise ValueError(f"SlotTable: num_slots must be >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.keys = keys
        self.policy = policy
        policy.set_capacity(num_slots)
        self._slot_of: dict[ExpertKey, int] = {}
        self._key_at: list[ExpertKey | None] = [None] * num_slots
        self.banks = banks
        self._ranges = banks.ranges if banks is not None else [range(num_slots)]
        self._free: list[list[int]] = [list(r) for r in self._ranges]  # per bank, valid min-heaps
        self._pins: dict[ExpertKey, int] = {}
        self._unpinned = 0  # keys whose last pin went
        # `_take_slot`'s predicate, kept while it can only have grown stricter (the same
        # `protect`, which only grows while used, the same bank, no pin gone since): an
        # eviction policy may then skip what it found not evictable before (LazyHeap).
        self._evictable: tuple[object, int, int, Callable[[ExpertKey], bool]] | None = None
        self._state: dict[ExpertKey, SlotState] = {}
        self._prefetched: set[ExpertKey] = set()  # installed by prefetch, not yet demanded
        self._withdrawn: set[int] = set()  # out of use while memory is short
        # Bumped whenever which key is ready in which slot changes: the compute actor's
        # device-side expert -> slot map is rebuilt only then.
        self.version = 0
        # How many times each slot was given to a key: a key evicted and given its old slot
        # back has the same slot, not the same bytes throughout (`SlotMap.held`).
        self.taken = [0] * num_slots
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        # Told of every key evicted (the router: a read landing for it must stop).
        self.on_evict: Callable[[ExpertKey], None] | None = None
        self.prefetch_installs = 0
        self.prefetch_used = 0
        self.prefetch_wasted = 0
        self.prefetch_dropped = 0

    # -- queries ---------------------------------------------------------------------------

    def lookup(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def resident(self) -> list[ExpertKey]:
        return sorted(self._slot_of)

    def state(self, key: ExpertKey) -> SlotState:
        self._require(key)
        return self._state[key]

    def ready(self, key: ExpertKey) -> bool:
        """Whether `key` is resident with its weights installed (any key, resident or not)."""
        return self._state.get(key) == "ready"

    def pin_count(self, key: ExpertKey) -> int:
        return self._pins.get(key, 0)

    def key_at(self, slot: int) -> ExpertKey | None:
        return self._key_at[slot]

    @property
    def layer_slots(self) -> int:
        """The slots one layer's experts may take at most: its bank's (the smallest)."""
        return self.num_slots if self.banks is None else self.banks.smallest

    @property
    def pinned(self) -> int:
        return len(self._pins)

    # -- mutation --------------------------------------------------------------------------

    def acquire(
        self,
        key: ExpertKey,
        tick: int,
        *,
        pin: bool,
        prefetch: bool = False,
        protect: Container[ExpertKey] = (),
    ) -> tuple[int, bool]:
        """Place `key` in the pool; return (slot, was_resident).

        A demand acquire (prefetch=False) counts a hit or a miss and touches the policy. A
        prefetch acquire of a resident key changes nothing; of a new key it installs it as
        a prefetch. Keys in `protect` are never chosen as victims; a `protect` passed again
        may have grown since, never shrunk (PoolDriver's are). Raises PoolExhausted if
        every resident key is pinned or protected.
        """
        slot = self._slot_of.get(key)
        if slot is not None:
            if not prefetch:
                self.hits += 1
                if self.keys is None or self.usable < self.keys:
                    self.policy.touch(key, tick)
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    self.prefetch_used += 1
            if pin:
                self._pins[key] = self._pins.get(key, 0) + 1
            return slot, True
        slot = self._take_slot(protect, self.bank_of(key))
        self.version += 1
        self._slot_of[key] = slot
        self._key_at[slot] = key
        self.taken[slot] += 1
        self._state[key] = "loading"
        self.policy.insert(key, tick)
        if prefetch:
            self.prefetch_installs += 1
            self._prefetched.add(key)
        else:
            self.misses += 1
        if pin:
            self._pins[key] = self._pins.get(key, 0) + 1
        return slot, False

    def try_prefetch(
        self, key: ExpertKey, tick: int, *, protect: Container[ExpertKey] = ()
    ) -> int | None:
        """Install `key` as a prefetch if room exists; None (and prefetch_dropped += 1) if not.

        Returns the slot to load into, or None when the key was already resident or dropped.
        """
        if key in self._slot_of:
            return None
        try:
            slot, _ = self.acquire(key, tick, pin=False, prefetch=True, protect=protect)
        except PoolExhausted:
            self.prefetch_dropped += 1
            return None
        return slot

    def bank_of(self, key: ExpertKey) -> int:
        """The bank `key` takes its slot in (0: the pool is one bank)."""
        return 0 if self.banks is None else self.banks.home[key[0]]

    def _bank_of_slot(self, slot: int) -> int:
        return 0 if self.banks is None else self.banks.of_slot(slot)

    def _take_slot(self, protect: Container[ExpertKey], bank: int) -> int:
        if self._free[bank]:
            return heapq.heappop(self._free[bank])

        cached = self._evictable
        if cached is not None and cached[0] is protect and cached[1] == bank and cached[2] == self._unpinned:
            evictable = cached[3]
        else:
            evictable = self._predicate(protect, bank)
            self._evictable = (protect, bank, self._unpinned, evictable)
        victim = self.policy.victim(evictable)
        if victim is None:
            raise PoolExhausted(
                f"expert pool exhausted: {len(self._pins)} of {self.num_slots} slots pinned"
                f" and the rest protected; nothing can be evicted"
            )
        return self._evict(victim)

    def _predicate(self, protect: Container[ExpertKey], bank: int) -> Callable[[ExpertKey], bool]:
        pins = self._pins
        if self.banks is None:  # the common case, asked several times a victim: no bank test

            def evictable(k: ExpertKey) -> bool:
                return k not in pins and k not in protect

            return evictable
        home = self.banks.home

        def in_bank(k: ExpertKey) -> bool:
            return k not in pins and k not in protect and home[k[0]] == bank

        return in_bank

    def _evict(self, key: ExpertKey) -> int:
        """Drop `key` (not pinned) from the pool; its slot, now empty."""
        slot = self._slot_of.pop(key)
        self._key_at[slot] = None
        del self._state[key]
        self.policy.remove(key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)
        if key in self._prefetched:
            self._prefetched.discard(key)
            self.prefetch_wasted += 1
        return slot

    # -- capacity under memory pressure (pipeline/memory_pressure.py) ----------------------

    @property
    def usable(self) -> int:
        """Slots keys may occupy: all of them, less those withdrawn under pressure."""
        return self.num_slots - len(self._withdrawn)

    def withdraw(self, count: int, keep: int = 0) -> list[int]:
        """Take up to `count` slots out of use, highest first (each bank's in turn): free
        ones, then ones whose key is ready and unpinned (evicted). Slots in use by a pinned
        or loading key stay (a later call may take them), and every bank keeps `keep`
        usable slots (what one layer pins: its keys take slots in their bank only).
        Returns the slots withdrawn, for their memory."""
        taken: list[int] = []
        usable = [sum(1 for s in r if s not in self._withdrawn) for r in self._ranges]
        for slot in self._top_down():
            if len(taken) == count:
                break
            bank = self._bank_of_slot(slot)
            if slot in self._withdrawn or usable[bank] <= keep:
                continue
            key = self._key_at[slot]
            if key is not None:
                if key in self._pins or self._state[key] != "ready":
                    continue
                self._evict(key)
                self.version += 1
            taken.append(slot)
            usable[bank] -= 1
        if taken:
            self._withdrawn.update(taken)
            for free in self._free:
                free[:] = [s for s in free if s not in self._withdrawn]
                heapq.heapify(free)
        return taken

    def _top_down(self) -> list[int]:
        """Slots from the highest, one bank's then the next's in turn (so every bank keeps
        its share when slots are withdrawn)."""
        tops = [list(reversed(r)) for r in self._ranges]
        return [t[i] for i in range(max(map(len, tops))) for t in tops if i < len(t)]

    def restore(self, count: int) -> list[int]:
        """Give up to `count` withdrawn slots back (lowest first); returns them."""
        back = sorted(self._withdrawn)[:count]
        for slot in back:
            self._withdrawn.discard(slot)
            heapq.heappush(self._free[self._bank_of_slot(slot)], slot)
        return back

    def mark_ready(self, key: ExpertKey) -> None:
        self._require(key)
        self._state[key] = "ready"
        self.version += 1

    def ready_items(self) -> list[tuple[ExpertKey, int]]:
        """(key, slot) of every key whose weights are installed."""
        return [(k, s) for k, s in self._slot_of.items() if self._state[k] == "ready"]

    def release(self, key: ExpertKey) -> None:
        """Give back the slot of `key` (its load failed). Pins on it are dropped."""
        self._require(key)
        slot = self._slot_of.pop(key)
        self.version += 1
        self._key_at[slot] = None
        del self._state[key]
        self._pins.pop(key, None)
        self._prefetched.discard(key)
        self.policy.remove(key)
        heapq.heappush(self._free[self._bank_of_slot(slot)], slot)

    def pin(self, key: ExpertKey) -> None:
        self._require(key)
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: ExpertKey) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise KeyError(f"SlotTable.unpin: expert {key} (layer, expert) is not pinned")
        if count == 1:
            del self._pins[key]
            self._unpinned += 1  # a key may be evicted again: `_take_slot`'s predicate is new
        else:
            self._pins[key] = count - 1

    def _require(self, key: ExpertKey) -> None:
        if key not in self._slot_of:
            raise KeyError(f"SlotTable: expert {key} (layer, expert) is not resident")

    def snapshot(self) -> SlotCounters:
        return SlotCounters(
            num_slots=self.num_slots,
            resident=len(self._slot_of),
            pinned=len(self._pins),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            prefetch_installs=self.prefetch_installs,
            prefetch_used=self.prefetch_used,
            prefetch_wasted=self.prefetch_wasted,
            prefetch_dropped=self.prefetch_dropped,
        )
