"""Prefix reuse: model states (KV cache + DeltaNet recurrent state) after token sequences.

A follow-up chat turn re-sends the whole conversation, and agents re-send the same
prompt; when a request's tokens start with a sequence whose state we kept, only the
rest is computed. Gated DeltaNet state cannot be rewound to an earlier token, so a state
is reusable only at the exact point it was taken. A generation keeps a checkpoint
after all prompt tokens but the last (what a re-sent prompt, or a follow-up whose
template renders the previous reply differently from how it was generated, can still
use), one at each prefill chunk boundary that crosses a multiple of `interval` tokens
(what a prompt sharing a long start, such as a system prompt and tools, uses), and the
state at its end (what a follow-up that repeats the reply token for token uses).

`take` hands out a copy, so entries survive use; entries are dropped least recently used
first, to stay within a byte budget. Every operation runs on the MLX thread
(`worker.run`): copies are MLX work, and one thread needs no lock.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import structlog

from pipeline.models.kv_quant import kv_parts, set_kv_parts

log = structlog.get_logger("moestream.prefix_cache")

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_INTERVAL = 1024  # tokens between mid-prompt checkpoints (each one is a state copy)


def _arrays(cache: list[Any]) -> list[mx.array]:
    out: list[mx.array] = []
    for c in cache:
        if hasattr(c, "offset"):
            out += kv_parts(c)
        for a in getattr(c, "cache", None) or []:
            if isinstance(a, mx.array):
                out.append(a)
    return out


def snapshot(cache: list[Any]) -> list[Any]:
    """A copy of a model cache that later updates of either side leave alone.

    KV caches (mlx-lm's `KVCache`, `QuantizedKVCache`) are written in place, so their
    arrays are copied up to the filled length; recurrent caches (`ArraysCache`) replace their arrays on every
    step, so a new list of the same arrays is enough.
    """
    out = []
    for c in cache:
        new = copy.copy(c)
        if hasattr(c, "offset") and hasattr(c, "keys"):
            if c.keys is not None:  # a quantized cache's (data, scales, biases) alike
                set_kv_parts(new, [mx.contiguous(a) for a in kv_parts(c, filled=True)])
        elif isinstance(getattr(c, "cache", None), list):
            new.cache = list(c.cache)
        else:
            raise TypeError(f"cannot snapshot a {type(c).__name__}")
        out.append(new)
    mx.eval(_arrays(out))
    return out


def nbytes(cache: list[Any]) -> int:
    return sum(a.nbytes for a in _arrays(cache))


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = 16,
                 interval: int = DEFAULT_INTERVAL) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.interval = interval
        self._entries: OrderedDict[tuple[int, ...], tuple[list[Any], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self.usage()[1]

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) from any thread: the entries are copied in one step under the
        GIL, so a `put` on the MLX thread never changes them while they are summed."""
        entries = list(self._entries.values())
        return len(entries), sum(n for _, n in entries)

    def longest(self, tokens: Sequence[int]) -> int:
        """How many tokens `take` would give back (0: none), without a copy."""
        best = self._longest(tokens)
        return 0 if best is None else len(best)

    def _longest(self, tokens: Sequence[int]) -> tuple[int, ...] | None:
        best: tuple[int, ...] | None = None
        for seq in self._entries:
            if len(seq) < len(tokens) and (best is None or len(seq) > len(best)):
                if tuple(tokens[: len(seq)]) == seq:
                    best = seq
        return best

    def take(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """A copy of the longest stored state whose sequence is a proper prefix of `tokens`
        (at least one token is left to compute: the next logits come from it)."""
        best = self._longest(tokens)
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        try:
            return snapshot(self._entries[best][0]), len(best)
        except TypeError:  # a cache kind `snapshot` does not know: hand it out, once
            return self._entries.pop(best)[0], len(best)

    def put(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep `cache` (the caller is done with it) as the state after `tokens`."""
        if self.max_entries <= 0 or not tokens:
            return
        size = nbytes(cache)
        if size > self.max_bytes:
            log.debug("prefix_cache.too_large", tokens=len(tokens), bytes=size)
            return
        key = tuple(tokens)
        self._entries[key] = (cache, size)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._entries.popitem(last=False)

    def wants(self, before: int, after: int, end: int) -> bool:
        """Whether to checkpoint after a prefill chunk that took the state from `before` to
        `after` tokens, of `end` before the last prompt token."""
        return after == end or after // self.interval > before // self.interval

    def checkpoint(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep a copy of `cache` (which goes on changing) as the state after `tokens`."""
        if nbytes(cache) > self.max_bytes:
            return  # not copied only to be refused by `put`
        self.piecewise(tokens, cache)(None)

    def piecewise(self, tokens: Sequence[int], cache: list[Any]) -> Callable[[int | None], None]:
        """The checkpoint after `tokens`, copied a range of layers at a time while a paired
        step runs (actors/pair_step.py): `between(upto)` copies the layers below `upto`
        not copied yet; at None, the rest, and keeps the copy (as `checkpoint` does)."""
        parts: list[Any] = []
        wanted = self.max_entries > 0 and bool(tokens) and tuple(tokens) not in self._entries

        def between(upto: int | None) -> None:
            nonlocal wanted
            stop = len(cache) if upto is None else upto
            if wanted and len(parts) < stop:
                try:
                    parts.extend(snapshot(cache[len(parts) : stop]))
                except TypeError as exc:  # a cache kind `snapshot` does not know: no checkpoints
                    log.debug("prefix_cache.no_checkpoint", reason=str(exc))
                    wanted = False
            if upto is None and wanted:
                self.put(tokens, parts)

        return between

    def clear(self) -> None:
        self._entries.clear()
