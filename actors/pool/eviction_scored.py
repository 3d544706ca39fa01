"""Eviction policies that the routing literature found better than plain LRU / LFU.

Registered in actors/pool/eviction.py beside LRU, LFU and SLRU ("flru", "reuse", "pin");
like them, each is a deterministic function of the call sequence, so traces replay
exactly. Time is the SlotTable's tick (one per token and MoE layer); the policies turn it
into tokens by dividing by the number of distinct layers they have seen, which is the
number of MoE layers after the first token.

- `FreqLRU` ("flru"): score = weight x uses + last use (in tokens), evict the lowest.
  flash-moe ran Qwen3.5-397B at 5.86 tok/s with this score (weight 10) against 3.55 with
  plain LRU. Uses count while the key is resident (an evicted key starts again at 1).
- `ReuseDistance` ("reuse"): each key keeps an average of the gaps between its uses; the
  victim is the key whose next use looks furthest away, max(average gap, time since last
  use): a key used every few tokens is kept even if another was touched more recently, and
  one that is long overdue (stale) goes whatever its past rate. Keys seen once take the
  average gap of all keys as their own.
- `PinHot` ("pin"): the `fraction` x pool most used keys (counts over the whole run, so
  evicted keys keep theirs) are never chosen while another key can go; the rest is LRU.
  With fraction ~0.15 this pins the "universal" experts (~15 % of experts in Qwen3-Next /
  Qwen3-30B-A3B are used by every domain). The hot set is kept exact as counts grow (a
  key joins it when its count passes the lowest hot count).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from actors.pool.heap_scan import LazyHeap
from actors.pool.heap_scan import missing as _missing

ExpertKey = tuple[int, int]
Evictable = Callable[[ExpertKey], bool]


class _TokenClock:
    """Ticks -> tokens: one tick per (token, MoE layer), counted from the first tick seen
    (the live engine's ticks start at 1 and replay's at 0: same tokens either way)."""

    def __init__(self) -> None:
        self._layers: set[int] = set()
        self._origin: int | None = None

    def tokens(self, key: ExpertKey, tick: int) -> float:
        self._layers.add(key[0])
        if self._origin is None:
            self._origin = tick
        return (tick - self._origin) / len(self._layers)


class FreqLRU:
    name = "flru"

    def __init__(self, weight: float = 10.0) -> None:
        if weight < 0:
            raise ValueError(f"flru: weight must be >= 0, got {weight!r}")
        self.weight = float(weight)
        self._clock = _TokenClock()
        self._uses: dict[ExpertKey, int] = {}
        self._seq: dict[ExpertKey, int] = {}
        self._next = 0
        self._heap = LazyHeap()

    def params(self) -> dict[str, float]:
        return {"weight": self.weight}

    def set_capacity(self, num_slots: int) -> None:
        pass

    def _access(self, key: ExpertKey, tick: int) -> None:
        uses = self._uses[key] = self._uses.get(key, 0) + 1
        self._next += 1
        self._seq[key] = self._next
        score = self.weight * uses + self._clock.tokens(key, tick)
        self._heap.push((score, self._next, key), self._seq)

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._seq:
            raise KeyError(f"flru: expert {key} inserted twice")
        self._access(key, tick)

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._seq:
            raise _missing(self.name, key)
        self._access(key, tick)

    def remove(self, key: ExpertKey) -> None:
        if key not in self._seq:
            raise _missing(self.name, key)
        del self._seq[key]
        del self._uses[key]

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        return self._heap.victim(self._seq, evictable)

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, key: object) -> bool:
        return key in self._seq


class ReuseDistance:
    name = "reuse"

    def __init__(self, smoothing: float = 0.5) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"reuse: smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self._clock = _TokenClock()
        self._last_seen: dict[ExpertKey, float] = {}  # every key ever used: last use
        self._gap_of: dict[ExpertKey, float] = {}  # keys used twice or more: average gap
        self._gap_sum = 0.0
        self._gap_n = 0
        self._now = 0.0
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # resident, by last use
        self._fresh: OrderedDict[ExpertKey, None] = OrderedDict()  # resident, no gap yet
        self._seq: dict[ExpertKey, int] = {}
        self._next = 0
        self._heap = LazyHeap()  # (-gap, seq, key)

    def params(self) -> dict[str, float]:
        return {"smoothing": self.smoothing}

    def set_capacity(self, num_slots: int) -> None:
        pass

    def _use(self, key: ExpertKey, tick: int) -> None:
        now = self._now = self._clock.tokens(key, tick)
        prev = self._last_seen.get(key)
        if prev is not None:
            gap = max(now - prev, 0.0)
            self._gap_sum += gap
            self._gap_n += 1
            old = self._gap_of.get(key)
            self._gap_of[key] = gap if old is None else old + self.smoothing * (gap - old)
        self._last_seen[key] = now
        self._order[key] = None
        self._order.move_to_end(key)
        self._next += 1
        self._seq[key] = self._next
        if key in self._gap_of:
            self._fresh.pop(key, None)
            self._heap.push((-self._gap_of[key], self._next, key), self._seq)
        else:
            self._fresh[key] = None

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._seq:
            raise KeyError(f"reuse: expert {key} inserted twice")
        self._use(key, tick)

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._seq:
            raise _missing(self.name, key)
        self._use(key, tick)

    def remove(self, key: ExpertKey) -> None:
        if key not in self._seq:
            raise _missing(self.name, key)
        del self._seq[key]
        del self._order[key]
        self._fresh.pop(key, None)

    def _longest_gap(self, evictable: Evictable) -> tuple[float, ExpertKey] | None:
        entry = self._heap.peek(self._seq, evictable)
        return None if entry is None else (-entry[0], entry[2])

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        # score(k) = max(gap(k), now - last(k)); the max over keys of a max is the larger of
        # the longest gap, the prior (any key without a gap) and the oldest last use, so
        # three O(log n) candidates replace a scan. Ties go to the stalest key.
        best: tuple[float, int, ExpertKey] | None = None
        for k in self._order:
            if evictable(k):
                best = (self._now - self._last_seen[k], 2, k)
                break
        longest = self._longest_gap(evictable)
        if longest is not None and (best is None or (longest[0], 1) > best[:2]):
            best = (longest[0], 1, longest[1])
        for k in self._fresh:
            if evictable(k):
                prior = self._gap_sum / self._gap_n if self._gap_n else 0.0
                if best is None or (prior, 0) > best[:2]:
                    best = (prior, 0, k)
                break
        return None if best is None else best[2]

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, key: object) -> bool:
        return key in self._seq


class PinHot:
    name = "pin"

    def __init__(self, fraction: float = 0.15) -> None:
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"pin: fraction must be in [0, 1), got {fraction!r}")
        self.fraction = float(fraction)
        self._hot_size = 0
        self._count: dict[ExpertKey, int] = {}  # every key ever used (whole-run counts)
        self._hot: set[ExpertKey] = set()  # the hot_size most used keys, resident or not
        self._hot_heap: list[tuple[int, int, ExpertKey]] = []  # (count, seq, key): lazy min
        self._last: dict[ExpertKey, int] = {}  # resident key -> sequence number of last use
        self._cold: list[tuple[int, ExpertKey]] = []  # (last, key) of cold residents: lazy
        self._next = 0

    def params(self) -> dict[str, float]:
        return {"fraction": self.fraction}

    def set_capacity(self, num_slots: int) -> None:
        self._hot_size = int(self.fraction * num_slots)

    def _promote(self, key: ExpertKey, count: int) -> None:
        """Keep `_hot` = the hot_size highest counts; a newcomer must beat the lowest."""
        if key in self._hot:
            heapq.heappush(self._hot_heap, (count, self._next, key))
            return
        if len(self._hot) < self._hot_size:
            self._hot.add(key)
            heapq.heappush(self._hot_heap, (count, self._next, key))
            return
        while self._hot_heap:
            low, _, low_key = self._hot_heap[0]
            if low_key not in self._hot or self._count[low_key] != low:
                heapq.heappop(self._hot_heap)  # stale
                continue
            if count <= low:
                return
            heapq.heappop(self._hot_heap)
            self._hot.discard(low_key)
            if low_key in self._last:  # demoted while resident: evictable again, by recency
                heapq.heappush(self._cold, (self._last[low_key], low_key))
            self._hot.add(key)
            heapq.heappush(self._hot_heap, (count, self._next, key))
            return

    def _access(self, key: ExpertKey) -> None:
        self._next += 1
        self._last[key] = self._next
        count = self._count[key] = self._count.get(key, 0) + 1
        self._promote(key, count)
        if key not in self._hot:
            heapq.heappush(self._cold, (self._next, key))
            if len(self._cold) > 4 * len(self._last) + 64:
                live = [e for e in self._cold if self._valid(e)]
                heapq.heapify(live)
                self._cold = live

    def _valid(self, entry: tuple[int, ExpertKey]) -> bool:
        last, key = entry
        return self._last.get(key) == last and key not in self._hot

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._last:
            raise KeyError(f"pin: expert {key} inserted twice")
        self._access(key)

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._last:
            raise _missing(self.name, key)
        self._access(key)

    def remove(self, key: ExpertKey) -> None:
        if self._last.pop(key, None) is None:
            raise _missing(self.name, key)

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        skipped = []
        found = None
        while self._cold:
            entry = self._cold[0]
            if not self._valid(entry):
                heapq.heappop(self._cold)
                continue
            if evictable(entry[1]):
                found = entry[1]
                break
            skipped.append(heapq.heappop(self._cold))
        for entry in skipped:
            heapq.heappush(self._cold, entry)
        if found is None:  # only hot keys can go: the least recently used of them (rare)
            hot = [(last, k) for k, last in self._last.items() if k in self._hot and evictable(k)]
            found = min(hot)[1] if hot else None
        return found

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last
