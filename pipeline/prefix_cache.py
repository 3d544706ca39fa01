"""Prefix reuse: model state (KV cache + DeltaNet recurrent state) after a token sequence.

A follow-up chat turn re-sends the whole conversation; when its tokens start with a
sequence whose state we kept, only the new tokens are computed. Gated DeltaNet state
cannot be rewound, so an entry is reusable only as a whole prefix, and it is taken out
of the cache when reused (the generation mutates it). Bounded by entry count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class PrefixCache:
    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """The longest stored state whose sequence is a proper prefix of `tokens`."""
        best: tuple[int, ...] | None = None
        for seq in self._entries:
            if len(seq) < len(tokens) and (best is None or len(seq) > len(best)):
                if tuple(tokens[: len(seq)]) == seq:
                    best = seq
        if best is None:
            return None, 0
        return self._entries.pop(best), len(best)

    def put(self, tokens: Sequence[int], cache: list[Any]) -> None:
        if self.max_entries <= 0 or not tokens:
            return
        key = tuple(tokens)
        self._entries[key] = cache
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
