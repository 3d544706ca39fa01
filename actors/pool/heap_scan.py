"""What the heap-ordered eviction policies share: the lazy-deletion victim scan.

A policy keeps `(priority, seq, key)` entries in a min-heap and `live[key] = seq` for the
entry that is current; older entries of a key (touched or removed since) are stale and
dropped when they surface, so touching a key costs one push, not a heap search.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

ExpertKey = tuple[int, int]


def missing(policy: str, key: ExpertKey) -> KeyError:
    return KeyError(f"{policy}: expert {key} (layer, expert) is not resident")


def lazy_heap_victim(heap: list[tuple[Any, int, ExpertKey]], live: Mapping[ExpertKey, int],
                     evictable: Callable[[ExpertKey], bool]) -> ExpertKey | None:
    """The lowest-priority current key that `evictable` allows, or None; the heap is left
    as it was apart from stale entries dropped."""
    skipped: list[tuple[Any, int, ExpertKey]] = []
    found: ExpertKey | None = None
    while heap:
        _, seq, key = heap[0]
        if live.get(key) != seq:
            heapq.heappop(heap)  # stale: the key was touched or removed since
            continue
        if evictable(key):
            found = key
            break
        skipped.append(heapq.heappop(heap))
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found
