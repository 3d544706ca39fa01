"""The samplers of a decode batch's rows, used as one: logits [rows, vocab] -> a token per row.

Each row keeps its own `Sampler` (its own parameters, RNG stream, penalty counts,
constraint), so a sequence draws exactly the tokens it would draw alone from the same
logits: row i's draw depends only on row i's logits and row i's key.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from actors.mx_typed import to_int
from actors.sampler import Sampler


class RowSamplers:
    def __init__(self, samplers: Sequence[Sampler]) -> None:
        self.samplers = list(samplers)

    def __len__(self) -> int:
        return len(self.samplers)

    @property
    def lazy_ok(self) -> bool:
        """Whether every row can draw before the previous token is on the host."""
        return all(s.lazy_ok for s in self.samplers)

    def draw(self, logits: mx.array) -> mx.array:
        """A lazy token per row, shape [rows] (not recorded)."""
        return mx.stack([s.draw(logits[i]) for i, s in enumerate(self.samplers)])

    def sample(self, logits: mx.array) -> list[int]:
        """A token per row, recorded (the rows that can draw lazily share one sync)."""
        lazy = {i: s.draw(logits[i]) for i, s in enumerate(self.samplers) if s.lazy_ok}
        mx.eval(list(lazy.values()))
        out: list[int] = []
        for i, s in enumerate(self.samplers):
            if i in lazy:
                token = to_int(lazy[i])
                s.record(token)
            else:
                token = s.sample(logits[i])
            out.append(token)
        return out

    def record(self, tokens: Sequence[int]) -> None:
        for s, t in zip(self.samplers, tokens, strict=True):
            s.record(t)

    @property
    def key(self) -> list[mx.array]:
        return [s.key for s in self.samplers]

    def restore_key(self, keys: Sequence[mx.array]) -> None:
        for s, k in zip(self.samplers, keys, strict=True):
            s.restore_key(k)
