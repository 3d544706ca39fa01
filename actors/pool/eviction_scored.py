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
  Qwen3-30B-A3B are used by every domain); the hot set is refreshed every `refresh` ticks.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

ExpertKey = tuple[int, int]
Evictable = Callable[[ExpertKey], bool]


def _missing(policy: str, key: ExpertKey) -> KeyError:
    return KeyError(f"{policy}: expert {key} (layer, expert) is not resident")


class _TokenClock:
    """Ticks -> tokens: one tick per (token, MoE layer)."""

    def __init__(self) -> None:
        self._layers: set[int] = set()

    def tokens(self, key: ExpertKey, tick: int) -> float:
        self._layers.add(key[0])
        return tick / len(self._layers)


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
        self._heap: list[tuple[float, int, ExpertKey]] = []

    def params(self) -> dict[str, float]:
        return {"weight": self.weight}

    def set_capacity(self, num_slots: int) -> None:
        pass

    def _access(self, key: ExpertKey, tick: int) -> None:
        uses = self._uses[key] = self._uses.get(key, 0) + 1
        self._next += 1
        self._seq[key] = self._next
        score = self.weight * uses + self._clock.tokens(key, tick)
        heapq.heappush(self._heap, (score, self._next, key))
        if len(self._heap) > 4 * len(self._seq) + 64:
            live = [e for e in self._heap if self._seq.get(e[2]) == e[1]]
            heapq.heapify(live)
            self._heap = live

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
        skipped = []
        found = None
        while self._heap:
            _, seq, key = self._heap[0]
            if self._seq.get(key) != seq:
                heapq.heappop(self._heap)  # stale entry
                continue
            if evictable(key):
                found = key
                break
            skipped.append(heapq.heappop(self._heap))
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

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
        self._index: dict[ExpertKey, int] = {}  # resident key -> row in the arrays
        self._keys: list[ExpertKey | None] = []
        self._last = np.zeros(0)
        self._gap = np.zeros(0)  # nan = never reused yet
        self._free: list[int] = []

    def params(self) -> dict[str, float]:
        return {"smoothing": self.smoothing}

    def set_capacity(self, num_slots: int) -> None:
        if num_slots > len(self._keys):
            grow = num_slots - len(self._keys)
            self._free.extend(range(len(self._keys), num_slots))
            self._keys.extend([None] * grow)
            self._last = np.concatenate([self._last, np.zeros(grow)])
            self._gap = np.concatenate([self._gap, np.full(grow, np.nan)])

    def _use(self, key: ExpertKey, tick: int) -> None:
        now = self._now = self._clock.tokens(key, tick)
        prev = self._last_seen.get(key)
        if prev is not None:
            gap = max(now - prev, 1e-9)
            self._gap_sum += gap
            self._gap_n += 1
            old = self._gap_of.get(key)
            self._gap_of[key] = gap if old is None else old + self.smoothing * (gap - old)
        self._last_seen[key] = now
        i = self._index[key]
        self._last[i] = now
        self._gap[i] = self._gap_of.get(key, np.nan)

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._index:
            raise KeyError(f"reuse: expert {key} inserted twice")
        if not self._free:
            self.set_capacity(max(8, 2 * len(self._keys)))  # unbound use (tests)
        i = heapq.heappop(self._free)
        self._index[key] = i
        self._keys[i] = key
        self._use(key, tick)

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._index:
            raise _missing(self.name, key)
        self._use(key, tick)

    def remove(self, key: ExpertKey) -> None:
        i = self._index.pop(key, None)
        if i is None:
            raise _missing(self.name, key)
        self._keys[i] = None
        self._gap[i] = np.nan
        heapq.heappush(self._free, i)

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        rows = np.fromiter(self._index.values(), dtype=np.int64, count=len(self._index))
        if rows.size == 0:
            return None
        prior = self._gap_sum / self._gap_n if self._gap_n else 1.0
        gap = np.nan_to_num(self._gap[rows], nan=prior)
        stale = self._now - self._last[rows]
        # Furthest expected next use first; ties to the least recently used, then the row.
        order = np.lexsort((rows, self._last[rows], -np.maximum(gap, stale)))
        for j in order:
            key = self._keys[int(rows[j])]
            if key is not None and evictable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index


class PinHot:
    name = "pin"

    def __init__(self, fraction: float = 0.15, refresh: int = 64) -> None:
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"pin: fraction must be in [0, 1), got {fraction!r}")
        if refresh < 1:
            raise ValueError(f"pin: refresh must be >= 1 tick, got {refresh!r}")
        self.fraction, self.refresh = float(fraction), int(refresh)
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()
        self._count: dict[ExpertKey, int] = {}
        self._hot: set[ExpertKey] = set()
        self._hot_size = 0
        self._refreshed_at: int | None = None
        self._tick = 0

    def params(self) -> dict[str, float]:
        return {"fraction": self.fraction, "refresh": self.refresh}

    def set_capacity(self, num_slots: int) -> None:
        self._hot_size = int(self.fraction * num_slots)

    def _access(self, key: ExpertKey, tick: int) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._tick = tick
        self._order[key] = None
        self._order.move_to_end(key)

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._order:
            raise KeyError(f"pin: expert {key} inserted twice")
        self._access(key, tick)

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._order:
            raise _missing(self.name, key)
        self._access(key, tick)

    def remove(self, key: ExpertKey) -> None:
        if self._order.pop(key, 0) is not None:
            raise _missing(self.name, key)

    def _refresh(self) -> None:
        if self._refreshed_at is not None and self._tick - self._refreshed_at < self.refresh:
            return
        self._refreshed_at = self._tick
        # Most used first; ties to the lower key, so the set is a function of the calls.
        ranked = heapq.nsmallest(self._hot_size, self._count.items(), key=lambda kv: (-kv[1], kv[0]))
        self._hot = {k for k, _ in ranked}

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        self._refresh()
        fallback = None
        for key in self._order:
            if not evictable(key):
                continue
            if key not in self._hot:
                return key
            if fallback is None:
                fallback = key
        return fallback

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
