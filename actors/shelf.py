"""Stale predictions taken off the read queue, and put back (the router's, actors/router.py).

When a layer is routed, a read still queued for one of its experts it did not choose is
shelved (taken off the queue) unless a disk thread has started it. With realistic routing
~40 % of the predictions are wrong; on a disk that cannot read them all in time they
queued behind each other (session 20: 48-217 ms a read) and the next layer's predictions
waited behind the last one's mistakes. The slot table is left as it is (the key keeps its
slot, "loading"), so the pool's decisions, and `replay`, do not depend on timing; the read
goes back on the queue when the key is demanded (`taken`), predicted again (`predicted`),
or the engine drains or settles (`requeue_all`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from actors.pool.eviction import ExpertKey
from actors.reader import ExpertReader, Load


class Shelf:
    def __init__(self, reader: ExpertReader) -> None:
        self.reader = reader
        self.count = 0  # loads shelved, still in the router's `loads` (their keys' slots)

    def stale(self, loads: Mapping[ExpertKey, Load], layer: int, ids: Sequence[int]) -> None:
        """`layer` is routed now: its unchosen experts' queued reads off the queue."""
        if not loads:
            return
        chosen = {int(e) for e in ids}
        stale = [load for key, load in loads.items()
                 if key[0] == layer and key[1] not in chosen and not load.started]
        if stale:
            self.count += self.reader.shelve(stale)

    def predicted(self, loads: Mapping[ExpertKey, Load],
                  predictions: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Shelved reads predicted again: back on the queue."""
        if self.count:
            again = [load for layer, ids in predictions for e in ids
                     if (load := loads.get((layer, int(e)))) is not None and load.shelved]
            self.count -= self.reader.requeue(again)

    def taken(self, load: Load) -> None:
        """`load` leaves the shelf another way: demanded (promoted) or dropped (evicted)."""
        if load.shelved:
            self.count -= 1

    def requeue_all(self, loads: Mapping[ExpertKey, Load]) -> None:
        """Every shelved read back on the queue: what drains and settles wait for."""
        if self.count:
            self.reader.requeue([load for load in loads.values() if load.shelved])
            self.count = 0
