"""Prompt-lookup drafts: the tokens that followed the latest earlier match of the text's
last n tokens (n from `max_n` down to `min_n`), over the prompt and the output so far.

No weights, any model. An index of every n-gram's latest end position is kept as tokens
arrive, so a proposal costs max_n dictionary look-ups, not a scan of the history.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramDrafter:
    on_mlx = False

    def __init__(self, tokens: Iterable[int] = (), *, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # (n-gram) -> the end of its latest occurrence that has a token after it.
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            end = len(self.tokens)
            # The n-grams ending here now have a continuation: `t`.
            for n in range(1, min(self.max_n, end) + 1):
                self._last[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that may come next (empty: no match, or k < 1)."""
        if k < 1:
            return []
        h = self.tokens
        for n in range(min(self.max_n, len(h)), self.min_n - 1, -1):
            end = self._last.get(tuple(h[len(h) - n :]))
            if end is not None:
                return h[end : end + k]
        return []
