"""Eviction policies for the expert pool.

A policy only orders the resident keys; the `SlotTable` owns slots, pins and counters and
asks the policy for a victim among the keys it may evict. Every policy is deterministic:
given the same sequence of calls it picks the same victims, which is what lets a recorded
routing trace replay to the live run's hit rate.

- `LFUDecay` (default): access counts that fade multiplicatively with time. Instead of
  scaling every count each tick (O(n)), an access at tick t adds growth(t) =
  (1/decay)^(t/period); comparing raw sums is then equivalent to comparing decayed counts.
  When growth gets large all raw sums are divided by it once (rare, amortised O(1)).
  Victim = smallest decayed count, ties -> least recently used. A heap with lazy
  invalidation keeps each operation O(log n) amortised.
- `LRU`: least recently used (an OrderedDict, O(1)).
- `SLRU`: segmented LRU. New keys enter probation; a second access promotes them to the
  protected segment. Keys that are inserted and never used again (a wrong prefetch, a
  one-off expert) are evicted from probation before anything proven useful.
- `FreqLRU`, `ReuseDistance`, `PinHot` (actors/pool/eviction_scored.py): frequency-weighted
  LRU, reuse distance / staleness, and pinning the most used ("universal") experts.

Recency is the order of calls (each call gets a sequence number), a total order, so no
ties remain for any policy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from actors.pool.heap_scan import LazyHeap
from actors.pool.heap_scan import missing as _missing

ExpertKey = tuple[int, int]
Evictable = Callable[[ExpertKey], bool]


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: ExpertKey, tick: int) -> None: ...

    def touch(self, key: ExpertKey, tick: int) -> None: ...

    def remove(self, key: ExpertKey) -> None: ...

    def victim(self, evictable: Evictable) -> ExpertKey | None: ...

    def params(self) -> dict[str, float]: ...

    def set_capacity(self, num_slots: int) -> None:
        """Told once by the SlotTable: how many keys can ever be resident."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def params(self) -> dict[str, float]:
        return {}

    def set_capacity(self, num_slots: int) -> None:
        pass

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._order:
            raise KeyError(f"lru: expert {key} inserted twice")
        self._order[key] = None

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._order:
            raise _missing(self.name, key)
        self._order.move_to_end(key)

    def remove(self, key: ExpertKey) -> None:
        if self._order.pop(key, 0) is not None:
            raise _missing(self.name, key)

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        # Pinned keys are few (about two layers' top-k), so the scan stops early.
        for key in self._order:
            if evictable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LFUDecay:
    name = "lfu"
    # exp(200) ~ 7e86: far from float overflow, and renormalising that rarely is free.
    _MAX_EXPONENT = 200.0

    def __init__(self, decay: float = 0.9, period: int = 512) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"lfu: decay must be in (0, 1], got {decay!r}")
        if period < 1:
            raise ValueError(f"lfu: period must be >= 1 tick, got {period!r}")
        self.decay = float(decay)
        self.period = int(period)
        self._log_growth = -math.log(self.decay) / self.period
        self._base_tick: int | None = None
        self._score: dict[ExpertKey, float] = {}
        self._last: dict[ExpertKey, int] = {}
        self._seq = 0
        self._heap = LazyHeap()

    def params(self) -> dict[str, float]:
        return {"decay": self.decay, "period": self.period}

    def set_capacity(self, num_slots: int) -> None:
        pass

    def _weight(self, tick: int) -> float:
        if self._base_tick is None:
            self._base_tick = tick
        exponent = (tick - self._base_tick) * self._log_growth
        if exponent > self._MAX_EXPONENT:
            factor = math.exp(exponent)
            for key in self._score:
                self._score[key] /= factor
            self._base_tick = tick
            self._rebuild()
            exponent = 0.0
        return math.exp(exponent)

    def _rebuild(self) -> None:
        self._heap.rebuild((self._score[k], seq, k) for k, seq in self._last.items())

    def _access(self, key: ExpertKey, tick: int) -> None:
        weight = self._weight(tick)  # first: it may rescale every score, this key's too
        self._score[key] = self._score.get(key, 0.0) + weight
        self._seq += 1
        self._last[key] = self._seq
        self._heap.push((self._score[key], self._seq, key), self._last)

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self._last:
            raise KeyError(f"lfu: expert {key} inserted twice")
        self._access(key, tick)

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key not in self._last:
            raise _missing(self.name, key)
        self._access(key, tick)

    def remove(self, key: ExpertKey) -> None:
        if key not in self._last:
            raise _missing(self.name, key)
        del self._last[key]
        del self._score[key]

    def frequency(self, key: ExpertKey, tick: int) -> float:
        """Decayed access count of `key` as seen at `tick` (for diagnostics and tests)."""
        if key not in self._score or self._base_tick is None:
            return 0.0
        return self._score[key] / math.exp((tick - self._base_tick) * self._log_growth)

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        return self._heap.victim(self._last, evictable)

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last


class SLRU:
    name = "slru"

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError(
                f"slru: protected_fraction must be in (0, 1), got {protected_fraction!r}"
            )
        self.protected_fraction = float(protected_fraction)
        self._probation: OrderedDict[ExpertKey, None] = OrderedDict()
        self._protected: OrderedDict[ExpertKey, None] = OrderedDict()
        self._capacity: int | None = None

    def params(self) -> dict[str, float]:
        return {"protected_fraction": self.protected_fraction}

    def set_capacity(self, num_slots: int) -> None:
        self._capacity = num_slots

    def insert(self, key: ExpertKey, tick: int) -> None:
        if key in self:
            raise KeyError(f"slru: expert {key} inserted twice")
        self._probation[key] = None

    def touch(self, key: ExpertKey, tick: int) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            raise _missing(self.name, key)
        del self._probation[key]
        self._protected[key] = None
        # The protected segment is a fraction of the pool (of what is resident if unbound).
        size = self._capacity if self._capacity is not None else len(self)
        cap = max(1, int(self.protected_fraction * size))
        while len(self._protected) > cap:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def remove(self, key: ExpertKey) -> None:
        if self._probation.pop(key, 0) is None:
            return
        if self._protected.pop(key, 0) is not None:
            raise _missing(self.name, key)

    def victim(self, evictable: Evictable) -> ExpertKey | None:
        for segment in (self._probation, self._protected):
            for key in segment:
                if evictable(key):
                    return key
        return None

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected


# Defined apart (they need no names from here, so either module can be imported first).
from actors.pool.eviction_scored import FreqLRU, PinHot, ReuseDistance  # noqa: E402

_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lfu": LFUDecay,
    "lru": LRU,
    "slru": SLRU,
    "flru": FreqLRU,
    "reuse": ReuseDistance,
    "pin": PinHot,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, **params: float) -> EvictionPolicy:
    """Build a policy by its registry name (POLICY_NAMES)."""
    factory = _POLICIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid names: {', '.join(POLICY_NAMES)}"
        )
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"eviction policy {name!r}: bad parameters {params!r}: {exc}") from exc
