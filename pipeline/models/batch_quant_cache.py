"""A decode batch's quantized KV cache: mlx-lm's `BatchKVCache` over `QuantizedKVCache`'s
(data, scales, biases) triples (compute.kv_bits with several sequences at once).

mlx-lm batches plain KV caches (left-padded rows, per-row offsets, a mask over the
padding) and quantizes single-sequence ones, never both. This is its `BatchKVCache` with
each of keys and values a triple of arrays, written as `QuantizedKVCache` writes them:
`mx.quantize` of the step's keys (each position's groups alone, so a row's codes are the
ones its lone cache holds) into buffers grown 256 positions at a time. Its `bits` and
`group_size` send mlx-lm's attention down the quantized kernels, as the lone cache does;
merge, extend, filter and extract move a row's triples as `BatchKVCache` moves its arrays,
padding with zeros (codes, scales and biases 0: a padded key or value dequantizes to 0,
and the mask keeps it out of the softmax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll

Triple = tuple[mx.array, mx.array, mx.array]


def _each(f: Callable[[mx.array], mx.array], t: Triple) -> Triple:
    a, b, c = (f(x) for x in t)
    return a, b, c


class BatchQuantizedKVCache(BatchKVCache):
    keys: Any  # None, or a Triple (mlx-lm's class holds one array each)
    values: Any

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def _empty(self, rows: int, heads: int, positions: int, dim: int, dtype: mx.Dtype) -> Triple:
        """Zero buffers for `dim`-wide keys or values (QuantizedKVCache's layout)."""
        per_word = 32 // self.bits
        shape = (rows, heads, positions)
        return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, steps = self._idx, keys.shape[2]
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            rows, heads = keys.shape[:2]
            grow = (self.step + steps - 1) // self.step * self.step
            new_k = self._empty(rows, heads, grow, keys.shape[3], keys.dtype)
            new_v = self._empty(rows, heads, grow, values.shape[3], keys.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = _each(lambda x: x[..., :prev, :], self.keys)
                    self.values = _each(lambda x: x[..., :prev, :], self.values)
                self.keys = _join(self.keys, new_k, axis=2)
                self.values = _join(self.values, new_v, axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + steps
        self._idx += steps
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = q_keys[i]
            self.values[i][..., prev : self._idx, :] = q_values[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return (_each(lambda x: x[..., : self._idx, :], self.keys),
                _each(lambda x: x[..., : self._idx, :], self.values))

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys = _each(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.keys)
            self.values = _each(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.values)
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))

    def filter(self, batch_indices: mx.array) -> None:
        """Keep `batch_indices`' rows (in that order), in place; less padding if all have some."""
        if self.keys is not None:
            self.keys = _each(lambda x: x[batch_indices], self.keys)
            self.values = _each(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = min(cast(list[int], self.left_padding.tolist()))
        if least > 0:
            if self.keys is not None:
                self.keys = _each(lambda x: x[..., least:, :], self.keys)
                self.values = _each(lambda x: x[..., least:, :], self.values)
            self._idx -= least
            self.left_padding -= least

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows, in place: both right-justified to the later write position."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            if c.keys is None:
                rows = c.offset.shape[0]
                k = _each(lambda x: mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), x.dtype), ref.keys)
                v = _each(lambda x: mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), x.dtype), ref.values)
            else:
                k, v = c.keys, c.values
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k = _each(lambda x: x[..., :right, :], k)
                v = _each(lambda x: x[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = _each(lambda x: mx.pad(x, widths), k)
                v = _each(lambda x: mx.pad(x, widths), v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(self), pad(other)
        self.keys = _join(k1, k2, axis=0)
        self.values = _join(v1, v2, axis=0)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([l1, l2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as the lone sequence's cache."""
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = cast(list[int], self.left_padding.tolist())[idx]

        def row(x: mx.array) -> mx.array:
            return mx.contiguous(x[idx : idx + 1, :, padding : self._idx])

        keys, values = _each(row, self.keys), _each(row, self.values)
        cache.state = (keys, values, keys[0].shape[2], self.group_size, self.bits)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """Lone sequences' `QuantizedKVCache`s as one batch, left-padded to the longest."""
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        merged = cls([longest - n for n in lengths], first.group_size, first.bits)
        if longest == 0:
            return merged
        full = next(c for c in caches if c.keys is not None)
        rows = len(caches)
        keys = _each(lambda x: mx.zeros((rows, x.shape[1], longest, x.shape[3]), x.dtype), full.keys)
        values = _each(lambda x: mx.zeros((rows, x.shape[1], longest, x.shape[3]), x.dtype),
                       full.values)
        for row, c in enumerate(caches):
            if c.keys is None:
                continue
            start = longest - c.offset
            for i in range(3):
                keys[i][row : row + 1, :, start:longest] = c.keys[i][..., : c.offset, :]
                values[i][row : row + 1, :, start:longest] = c.values[i][..., : c.offset, :]
        merged.keys, merged.values = keys, values
        merged.offset += longest
        merged._idx = longest
        return merged


def _join(first: Triple, second: Triple, axis: int) -> Triple:
    """Each array of `first` followed by its twin of `second` along `axis` (2: buffers
    grown along positions; 0: rows appended)."""
    a, b, c = (mx.concatenate([x, y], axis=axis) for x, y in zip(first, second, strict=True))
    return a, b, c
