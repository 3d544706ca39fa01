"""The one sequence of slot-table calls shared by the live pool and `moestream replay`.

Live and replayed runs must make EXACTLY the same SlotTable calls in the same order, or a
recorded trace would not replay to the live hit rate. Both drive a `PoolDriver`:

for each token (prefill step or decode step), for each MoE layer l in order, tick t
(one tick per (token, layer), increasing):

1. `demand(l, chosen, t)`: first unpin the previous layer's keys (they stayed pinned while
   that layer computed), then for each chosen expert e of l in router order:
   `acquire((l, e), t, pin=True, protect=chosen)` (no chosen key is evicted for
   another). Resident counts as a hit, even if the key is still loading from a
   prefetch; the live engine measures that wait as stall.
2. The strategy sees the true routing: `strategy.observe(l, chosen)`, then
   `preds = strategy.predict(l, chosen, hidden)`.
3. `prefetch(preds, t)`: for each (layer_j, ids) in the order given, each id in the
   order given (most confident first), if (layer_j, id) is not resident it is installed
   with `try_prefetch`. A prefetch never evicts a pinned key (layer l's experts are
   pinned here) nor a key installed by the same prefetch step; when no slot can be
   freed, the key is skipped and counted in `prefetch_dropped` (no exception).
4. `end_layer()` (optional; `demand` of the next layer does it): unpin layer l's keys.

The driver is plain Python: no trio, no MLX. The live engine calls it from the event loop
and issues reads for the keys it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.pool.eviction import ExpertKey
from actors.pool.slots import SlotTable

Predictions = Sequence[tuple[int, Sequence[int]]]


class PoolDriver:
    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self._pinned: list[ExpertKey] = []

    def demand(self, layer: int, ids: Sequence[int], tick: int) -> list[tuple[int, bool]]:
        """Acquire and pin layer `layer`'s chosen experts; [(slot, was_resident)] per id."""
        self.end_layer()
        out: list[tuple[int, bool]] = []
        keys = [(layer, int(expert)) for expert in ids]
        # A miss's slot never comes from another of the layer's chosen experts not pinned
        # yet (one read for nothing, then read again: 14 of a token's 39 demand reads on
        # the H200 once reads were collected as they ended, session 26).
        chosen = set(keys)
        for key in keys:
            out.append(self.table.acquire(key, tick, pin=True, protect=chosen))
            self._pinned.append(key)
        return out

    def prefetch(self, predictions: Predictions, tick: int) -> list[tuple[ExpertKey, int]]:
        """Install predicted experts; return [(key, slot)] that the reader must load."""
        installed: list[tuple[ExpertKey, int]] = []
        protect: set[ExpertKey] = set()
        exhausted: set[int] = set()  # banks (actors/pool/banks.py) where a prefetch was dropped
        for layer, ids in predictions:
            for expert in ids:
                key = (int(layer), int(expert))
                if key in self.table:
                    continue
                bank = self.table.bank_of(key)
                if bank in exhausted:
                    # Nothing changed in its bank since the last drop there: no fit either.
                    self.table.prefetch_dropped += 1
                    continue
                slot = self.table.try_prefetch(key, tick, protect=protect)
                if slot is None:
                    exhausted.add(bank)
                    continue
                protect.add(key)
                installed.append((key, slot))
        return installed

    def end_layer(self) -> None:
        """Unpin the keys of the last demanded layer (idempotent)."""
        for key in self._pinned:
            if self.table.pin_count(key) > 0:  # a failed load may have released it
                self.table.unpin(key)
        self._pinned.clear()
