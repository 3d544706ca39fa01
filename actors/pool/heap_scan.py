"""What the heap-ordered eviction policies share: a lazy-deletion heap and its victim scan.

A policy keeps `(priority, seq, key)` entries in a min-heap and `live[key] = seq` for the
entry that is current; older entries of a key (touched or removed since) are stale and
dropped when they surface, so touching a key costs one push, not a heap search.

An entry found at the top but not evictable (pinned by the layer computing, protected by
the prefetch placing it) is set aside, not pushed back: a prefetch step asks for several
victims in a row while the same keys are pinned, and the old scan popped and pushed the
same few entries again for each (on a 1 GiB pool at the 35B's shape, `reuse`'s victims
were 70 % of the placement's time: session 27). Set-aside entries that may go again
return to the heap before the next scan, so every victim is still the lowest-priority
current entry `evictable` allows: the same calls give the same victims as before.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ExpertKey = tuple[int, int]
Entry = tuple[Any, int, ExpertKey]


def missing(policy: str, key: ExpertKey) -> KeyError:
    return KeyError(f"{policy}: expert {key} (layer, expert) is not resident")


class LazyHeap:
    """`(priority, seq, key)` entries, lowest first; `live[key]` names each key's current seq."""

    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._aside: list[Entry] = []  # current when set aside, not evictable then
        self._aside_for: object = None  # the predicate they were found not evictable by

    def __len__(self) -> int:
        return len(self._heap) + len(self._aside)

    def push(self, entry: Entry, live: Mapping[ExpertKey, int]) -> None:
        """Add `entry`; when stale entries outnumber the live keys 4:1, drop them all."""
        heapq.heappush(self._heap, entry)
        if len(self._heap) + len(self._aside) > 4 * len(live) + 64:
            self.rebuild(e for e in (*self._heap, *self._aside) if live.get(e[2]) == e[1])

    def rebuild(self, entries: Iterable[Entry]) -> None:
        """The heap from `entries` alone (a policy rescaling its priorities)."""
        self._heap = list(entries)
        heapq.heapify(self._heap)
        self._aside = []
        self._aside_for = None

    def victim(self, live: Mapping[ExpertKey, int],
               evictable: Callable[[ExpertKey], bool]) -> ExpertKey | None:
        """The key of the lowest-priority current entry that `evictable` allows, or None."""
        heap = self._heap
        # The same predicate object again is one that has only grown stricter (SlotTable
        # keeps it only while so): what it refused stays refused.
        if self._aside and evictable is not self._aside_for:
            still: list[Entry] = []
            for entry in self._aside:
                if live.get(entry[2]) != entry[1]:
                    continue  # stale since
                if evictable(entry[2]):
                    heapq.heappush(heap, entry)
                else:
                    still.append(entry)
            self._aside = still
        self._aside_for = evictable
        while heap:
            _, seq, key = heap[0]
            if live.get(key) != seq:
                heapq.heappop(heap)  # stale: the key was touched or removed since
                continue
            if evictable(key):
                return key
            self._aside.append(heapq.heappop(heap))
        return None

    def peek(self, live: Mapping[ExpertKey, int],
             evictable: Callable[[ExpertKey], bool]) -> Entry | None:
        """The entry `victim` would name (None if none), left in place."""
        key = self.victim(live, evictable)
        return None if key is None else self._heap[0]
