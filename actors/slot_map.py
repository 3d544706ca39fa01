"""Which pool slot holds each ready expert: what a run-ahead token computes from.

The compute actor builds one `SlotMap` per version of the pool's table (rebuilt only
when an expert becomes ready or leaves) and hands it to every run-ahead launched before
the next change. On the device a layer's experts are looked up with one gather from a
row already relative to the layer's bank and already `uint32`, the index type MLX's
`gather_qmm` takes: on the H100 (session 33, docs/results.md) the engine's token ran ~10
kernels a MoE layer more than resident mlx-lm (the row's lookup, its offset and clamp,
three `int32 -> uint32` casts, a stack of "found" flags), each costing the host ~11 us to
encode in a token whose GPU was busy 6 of 37 ms. Whether every chosen expert was there
is answered on the host from the same table, once the token's ids are read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np


class ReadyTable(Protocol):
    """The pool's slot table as a map reads it (actors/pool/slots.py's `SlotTable`)."""

    version: int
    taken: list[int]  # per slot: how many times it was given to a key

    def ready_items(self) -> list[tuple[tuple[int, int], int]]: ...

    def lookup(self, key: tuple[int, int]) -> int | None: ...

    def ready(self, key: tuple[int, int]) -> bool: ...


def relative_slots(absolute: np.ndarray, first: np.ndarray | int) -> np.ndarray:
    """Absolute pool slots (-1: not ready) as the expert kernels index them: less their
    layer's first slot (its bank's), 0 where not ready, uint32 (MLX's index type for
    `gather_qmm`: int32 slots cost a cast per projection)."""
    return np.where(absolute >= 0, absolute - first, 0).astype(np.uint32)


@dataclass(eq=False)
class SlotMap:
    """`host[rows[layer], e]`: expert e of MoE layer `layer`'s absolute pool slot, -1
    where it is not ready. Immutable once built: a launched token keeps the map it used."""

    host: np.ndarray  # [moe layers, experts] int32
    rows: dict[int, int]  # MoE layer -> row
    version: int = -1  # the table's version it copies (`snapshot`)
    taken: np.ndarray | None = None  # [moe layers, experts]: each ready slot's `taken` count
    _relative: mx.array | None = field(default=None, repr=False)
    _complete: bool | None = field(default=None, repr=False)

    @property
    def complete(self) -> bool:
        """Every expert of every MoE layer ready: no token can miss, nothing is installed."""
        if self._complete is None:
            self._complete = bool((self.host >= 0).all())
        return self._complete

    def relative(self, first_of: Callable[[int], int]) -> mx.array:
        """The device table [moe layers, experts] uint32: each ready expert's slot less
        its layer's first slot (`first_of(layer)`, its bank's), 0 where not ready (a
        missing expert computes from slot 0; `present` throws that layer's output away).
        Built once per map, on the thread that launches from it."""
        if self._relative is None:
            firsts = np.zeros((len(self.host), 1), dtype=np.int64)
            for layer, row in self.rows.items():
                firsts[row, 0] = first_of(layer)
            self._relative = mx.array(relative_slots(self.host, firsts))
        return self._relative

    def lookup(self, layer: int, ids: mx.array, first_of: Callable[[int], int]) -> mx.array:
        """`ids`' slots relative to `layer`'s first slot, lazily: one gather (a row is a
        slice of the table, a view; an integer index would be a gather of its own)."""
        row = self.rows[layer]
        return self.relative(first_of)[row : row + 1].reshape(-1)[ids]

    def present(self, layers: list[int], ids: np.ndarray) -> np.ndarray:
        """[len(layers)] bool: every id of each layer (`ids` [layers, ...]) ready here."""
        rows = np.array([self.rows[layer] for layer in layers], dtype=np.int64)
        flat = ids.reshape(len(layers), -1).astype(np.int64)
        return np.asarray((self.host[rows[:, None], flat] >= 0).all(axis=1))

    def held(self, table: ReadyTable, layers: list[int], ids: np.ndarray) -> np.ndarray:
        """[len(layers)] bool: every id of each layer still ready in the table, in the slot
        this map gave it. On the event loop, once a step launched from this map has run,
        where the table moved since the map was copied: a queued step's bookkeeping of the
        token before (its prefetches) may have evicted an expert the step read and given
        its slot to a read that lands (on the CPU a memcpy, not ordered with MLX's stream),
        so a layer that found every expert in the map may not have read its weights."""
        if table.version == self.version:
            return np.ones(len(layers), dtype=bool)
        assert self.taken is not None, "a map made by `snapshot`"
        out = np.ones(len(layers), dtype=bool)
        for i, layer in enumerate(layers):
            row, taken = self.host[self.rows[layer]], self.taken[self.rows[layer]]
            for e in np.unique(ids[i]):
                key, slot = (layer, int(e)), int(row[int(e)])
                # The same slot is not enough: evicted, overwritten by another expert's
                # read and its own again, it held other bytes while the step ran.
                if table.lookup(key) != slot or not table.ready(key) or table.taken[slot] != taken[int(e)]:
                    out[i] = False
                    break
        return out


def snapshot(table: ReadyTable, rows: dict[int, int], num_experts: int) -> SlotMap:
    """The table's ready experts as a `SlotMap` of one version (its `version`). Called on the
    MLX thread while the event loop owns the table: labelled with the version read before
    the copy and copied again if the table moved meanwhile, since a map labelled newer
    than its contents would never be rebuilt (and could say an evicted expert is ready in
    a slot another one is being read into)."""
    while True:
        version = table.version
        try:
            items = table.ready_items()
        except RuntimeError:  # the table's dict changed size under the copy
            continue
        host = np.full((len(rows), num_experts), -1, dtype=np.int32)
        taken = np.zeros((len(rows), num_experts), dtype=np.int64)
        for (layer, expert), slot in items:
            row = rows.get(layer)
            if row is not None:
                host[row, expert] = slot
                taken[row, expert] = table.taken[slot]
        if table.version == version:
            return SlotMap(host, rows, version, taken)
