"""Several sequences' model states as one batch: merge, split, grow, shrink.

A sequence is prefilled alone, in its own caches (mlx-lm's `KVCache` per attention
layer, `ArraysCache` of conv + recurrent state per Gated DeltaNet layer). To decode
several at once their caches are merged per layer with mlx-lm's own batch machinery:
`BatchKVCache` left-pads the shorter key/value histories and masks the padding (its
per-row offsets drive RoPE; `BatchRotatingKVCache` does the same for sliding-window
layers' `RotatingKVCache`), and the DeltaNet states, fixed-size, simply stack. A
sequence that leaves is cut out (`filter`), one that joins is appended (`extend`), and
a sequence's own caches are taken back out (`extract`) when it leaves, so the prefix
cache and a lone sequence keep working on the plain single-row caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from pipeline.models.batch_quant_cache import BatchQuantizedKVCache
from pipeline.models.routing_override import Routed, requests_of, tagged
from pipeline.models.run_ahead import state_arrays


def _merge_layer(caches: Sequence[Any]) -> Any:
    first = caches[0]
    if isinstance(first, ArraysCache):
        return ArraysCache.merge(list(caches))
    if isinstance(first, KVCache):
        return BatchKVCache.merge(list(caches))
    if isinstance(first, QuantizedKVCache):  # compute.kv_bits
        return BatchQuantizedKVCache.merge(list(caches))
    if isinstance(first, RotatingKVCache):  # gpt-oss's sliding-window layers
        return BatchRotatingKVCache.merge(list(caches))
    raise TypeError(f"cannot batch a {type(first).__name__}")


class BatchCaches:
    """The cache operations a decode batch needs (`actors.forward.CacheBatcher`).

    `layers`: the layers this process runs (a pipeline rank's slice); the caches of the
    others stay empty and are carried along untouched (the first row's)."""

    # Benchmark-only calibrated routing tags each sequence's caches with its request
    # (pipeline/models/routing_override.py); the tags follow the rows.

    def __init__(self, layers: range | None = None) -> None:
        self.layers = layers

    def _ours(self, i: int) -> bool:
        return self.layers is None or i in self.layers

    def merge(self, caches: Sequence[list[Any]]) -> list[Any]:
        """One batched cache per layer from several sequences' caches (rows in order)."""
        merged = [_merge_layer([c[i] for c in caches]) if self._ours(i) else caches[0][i]
                  for i in range(len(caches[0]))]
        return tagged(merged, _requests(caches))

    def extend(self, batch: list[Any], caches: Sequence[list[Any]]) -> None:
        """Append sequences (their own caches) as new rows of `batch`, in place."""
        for i, layer in enumerate(self.merge(caches)):
            if self._ours(i):
                batch[i].extend(layer)
        if isinstance(batch, Routed):
            batch.requests += _requests(caches)

    def extract(self, batch: list[Any], row: int) -> list[Any]:
        """Row `row`'s caches, as the plain caches of a sequence decoded alone. Copied and
        evaluated: mlx-lm's `ArraysCache.extract` slices the batch's states (a view keeps
        the whole [B, ...] buffer alive) and its KV extract is lazy (the graph keeps the
        batch's keys and values), so a row kept by the prefix cache, charged one row's
        bytes, held the batch's (8x at a batch of 8)."""
        mine = requests_of(batch)
        caches = [c.extract(row) if self._ours(i) else c for i, c in enumerate(batch)]
        own = [c for i, c in enumerate(caches) if self._ours(i)]
        for c in own:
            if isinstance(c, ArraysCache):
                c.cache = [None if a is None else mx.contiguous(a) for a in c.cache]
        mx.eval([a for c in own for a in state_arrays(c.state)])
        return tagged(caches, None if mine is None else [mine[row]])

    def keep(self, batch: list[Any], rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order), in place."""
        index = mx.array(list(rows), dtype=mx.int32)
        for i, c in enumerate(batch):
            if self._ours(i):
                c.filter(index)
        if isinstance(batch, Routed):
            batch.requests = [batch.requests[r] for r in rows]


def _requests(caches: Sequence[list[Any]]) -> list[int | None]:
    """The request of each sequence (one row each), in order; None where untagged."""
    return [r for c in caches for r in requests_of(c) or [None]]
