"""Emulated drafts, for benchmarks and tests: a reference run's own tokens, a seeded
fraction corrupted.

Random-weight bench models make drafters that accept almost nothing, so the cost side
of speculation (verify passes, reads shared by a pass, DeltaNet recompute) is measured
with drafts that are right with probability `acceptance` per token: the tokens plain
decode produced for the same prompt, each replaced by another id with probability
1 - acceptance (decided once per position and seed, so re-proposing a position gives
the same draft). Reports label such runs as emulated: they say what speculation costs
and gives at that acceptance, not what any real drafter achieves.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence


class EmulatedDrafter:
    on_mlx = False

    def __init__(self, prompt: Sequence[int], reference: Sequence[int], acceptance: float,
                 vocab: int, seed: int = 0, longest: int | None = None) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")
        self.start = len(prompt)
        self.reference = list(reference)
        self.acceptance, self.vocab, self.seed = acceptance, vocab, seed
        self.length = len(prompt)
        self.longest = longest  # drafts per proposal at most (None: what the policy asks)

    def extend(self, tokens: Iterable[int]) -> None:
        self.length += sum(1 for _ in tokens)

    def _at(self, i: int) -> int:
        token = self.reference[i]
        rng = random.Random(self.seed * 1_000_003 + i)
        if rng.random() < self.acceptance:
            return token
        return (token + 1 + rng.randrange(self.vocab - 1)) % self.vocab

    def propose(self, k: int) -> list[int]:
        i = self.length - self.start
        k = k if self.longest is None else min(k, self.longest)
        return [self._at(j) for j in range(i, min(i + max(k, 0), len(self.reference)))]
