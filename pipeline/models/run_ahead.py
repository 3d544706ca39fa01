"""What a run-ahead (the whole token in one evaluation: `ForwardStep.launch_with`) hands
the host, and the cache snapshots a missed run-ahead or a verify pass resumes from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from actors.slot_map import SlotMap


@dataclass
class RunAhead:
    """What one run-ahead evaluation tells the host."""

    layers: list[int]  # MoE layers in order
    ids: np.ndarray  # [moe layers, tokens, top_k]
    present: np.ndarray  # [moe layers] bool: every chosen expert was in the pool
    logits: mx.array  # [vocab], valid only if present.all()
    slot_map: SlotMap | None = None  # the table the slots came from, if any (`present`'s)

    def first_miss(self) -> int | None:
        missing = np.flatnonzero(~self.present)
        return self.layers[int(missing[0])] if missing.size else None


@dataclass
class LazyRunAhead:
    """A launched run-ahead: still lazy, so the host can queue the next step first."""

    layers: list[int]
    # each MoE layer's ids [tokens, top_k], read back one by one: stacked on the device they
    # were a copy kernel a layer (the host stacks them in microseconds)
    ids: list[mx.array]
    # [moe layers] "every expert there" flags on the device, or the table the slots came
    # from (the host answers from it once the ids are read: actors/slot_map.py)
    present: mx.array | SlotMap
    logits: mx.array
    keep: list[mx.array]  # evaluated with it: residual streams for `resume`, cache states

    def arrays(self) -> list[mx.array]:
        flags = [self.present] if isinstance(self.present, mx.array) else []
        return [self.logits, *self.ids, *flags, *self.keep]

    def result(self) -> RunAhead:
        ids = np.stack([np.asarray(a) for a in self.ids])
        if isinstance(self.present, SlotMap):
            return RunAhead(self.layers, ids, self.present.present(self.layers, ids), self.logits, self.present)
        return RunAhead(self.layers, ids, np.asarray(self.present), self.logits)


def state_arrays(state: Any) -> list[mx.array]:
    """The arrays in a cache's `state` (a batched cache's state nests lists and ints)."""
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for part in state for a in state_arrays(part)]
    return []


def snapshot_cache(cache: Any) -> dict[str, Any]:
    # mlx-lm's caches: KVCache (keys/values buffers written at `offset`, so restoring the
    # offset is enough) and ArraysCache (a list whose entries are replaced, never written
    # into). A shallow copy of the attributes, lists copied, restores either exactly. But an
    # MLX array updated in place (`a[i] = x`) changes every reference to that object, and a
    # ring (RotatingKVCache, BatchRotatingKVCache: gpt-oss's sliding layers) writes over
    # live entries: after a miss, the step queued behind had overwritten the oldest key in
    # the window. So a ring's buffers, and any small array attribute (batched per-row
    # offsets), are held as distinct objects (a view: the cache's next write then copies
    # the window rather than writing through); plain KV buffers stay shared (no copy).
    return _owned(cache, vars(cache))


def restore_cache(cache: Any, snapshot: dict[str, Any]) -> None:
    vars(cache).clear()
    vars(cache).update(_owned(cache, snapshot))


def _owned(cache: Any, attrs: dict[str, Any]) -> dict[str, Any]:
    ring = hasattr(cache, "max_size")
    out = {}
    for k, v in attrs.items():
        if isinstance(v, list):
            v = list(v)
        elif isinstance(v, mx.array) and (ring or k not in ("keys", "values")):
            v = v[...]
        out[k] = v
    return out
