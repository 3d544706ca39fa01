"""Whether a draft is worth a verify pass, and how long it may be.

`ngram` / `mtp`: always draft, up to `max_draft` tokens. `auto` decides from what it
measures on this engine: the seconds of a plain decode step, the seconds of a verify
pass of each draft length (reads, recompute of the DeltaNet states and acceptance
included), and the acceptance a per drafted token (accepted / (accepted + rejections):
the estimate of a geometric acceptance). A pass of k drafts gives E(k) = 1 + a + ... +
a^k tokens, so it pays when E(k) x plain > pass(k). When no length pays (the cost of a
pass outgrows its tokens: a pool that misses, a text that does not repeat) it stops
speculating and probes one short pass now and then, at intervals that double while it
keeps losing, so its loss stays a small fraction of plain decode.

The guard: a pass of k drafts pins up to (k + 1) x top_k experts per MoE layer, so k is
cut to what the pool can pin (`pinnable_rows` - 1), never a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import structlog

SpeculativeMode = Literal["auto", "mtp", "ngram", "off"]

log = structlog.get_logger("moestream.speculative")

_ALPHA = 0.2  # weight of the newest measurement (costs)
_DECAY = 0.95  # per pass, of the acceptance counts (about the last 20 passes)
_PROBE_FIRST, _PROBE_MAX = 8, 512  # plain steps between probes while losing


@dataclass
class SpecStats:
    passes: int = 0  # verify passes
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # ... of them kept
    pass_tokens: int = 0  # tokens the passes gave (the drafts kept, one more each)
    plain_steps: int = 0  # decode steps of speculating rows that had no draft
    backoffs: int = 0  # times `auto` stopped speculating

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.pass_tokens / self.passes if self.passes else 0.0

    def add_pass(self, drafted: int, accepted: int) -> None:
        self.passes += 1
        self.proposed += drafted
        self.accepted += accepted
        self.pass_tokens += accepted + 1

    def since(self, before: SpecStats) -> SpecStats:
        return SpecStats(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))

    def copy(self) -> SpecStats:
        return SpecStats(**vars(self))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + _ALPHA * (new - old)


@dataclass
class SpeculationPolicy:
    max_draft: int = 3
    pinnable_rows: int = 1 << 30  # pool slots // top_k
    stats: SpecStats = field(default_factory=SpecStats)
    plain_s: float | None = None
    plain_priced: int = 0  # plain steps `plain_s` has seen
    pass_s: dict[int, float] = field(default_factory=dict)
    passes_of: dict[int, int] = field(default_factory=dict)  # passes seen per length
    kept: float = 0.0  # decayed counts: drafts kept, drafts rejected
    rejected: float = 0.0
    _losing: bool = False
    _wait: int = 0
    _probe_every: int = _PROBE_FIRST

    def fresh(self) -> SpeculationPolicy:
        """The same limits with nothing measured (a freshly opened engine's policy)."""
        return SpeculationPolicy(max_draft=self.max_draft, pinnable_rows=self.pinnable_rows)

    @property
    def longest(self) -> int:
        return max(0, min(self.max_draft, self.pinnable_rows - 1))

    @property
    def acceptance(self) -> float:
        """Per drafted token, optimistic (0.5) before any pass."""
        seen = self.kept + self.rejected
        return self.kept / seen if seen else 0.5

    def draft_len(self, mode: str, room: int) -> int:
        """Drafts to ask for at the next step; `room`: tokens the row may still take - 1."""
        k = min(self.longest, room)
        if k < 1 or mode == "off":
            return 0
        if mode != "auto":
            return k
        if not self.pass_s:
            # Measure the cheapest pass first: where drafts lose (a text that does not
            # repeat, compute that costs per position) the probe costs least; where they
            # pay, longer ones are tried next (priced as the nearest measured: `_best`).
            return 1
        if self.plain_s is None:
            return 0  # ... then a plain step
        best, gain = self._best(k)
        if gain >= 1.0:
            if self._losing:
                self._losing, self._probe_every = False, _PROBE_FIRST
            return best
        if not self._losing:
            self._losing, self._wait = True, self._probe_every
            self.stats.backoffs += 1
            log.info("speculative.backoff", acceptance=round(self.acceptance, 3),
                     plain_ms=round(self.plain_s * 1e3, 2),
                     pass_ms={n: round(s * 1e3, 2) for n, s in sorted(self.pass_s.items())})
        if self._wait > 0:
            self._wait -= 1
            return 0
        # A probe: one short pass, to see whether the regime changed.
        self._wait = self._probe_every = min(self._probe_every * 2, _PROBE_MAX)
        return 1

    def _best(self, k: int) -> tuple[int, float]:
        assert self.plain_s is not None
        a = self.acceptance
        out = (0, 0.0)
        for n in range(1, k + 1):
            # A length not measured yet costs what the nearest measured one did (so a
            # longer draft is tried once it may pay, and then measured).
            cost = self.pass_s.get(n) or self.pass_s[min(self.pass_s, key=lambda m: abs(m - n))]
            tokens = sum(a**i for i in range(n + 1))
            gain = tokens * self.plain_s / cost
            if gain > out[1]:
                out = (n, gain)
        return out

    def after_plain(self, seconds: float | None) -> None:
        """A plain step of a speculating row; its seconds, or None when it is no price
        of plain decode (the step that restarts the pipeline after a pass)."""
        self.stats.plain_steps += 1
        if seconds is not None:
            self.plain_priced += 1
            self.plain_s = _ema(self.plain_s, seconds)

    def after_pass(self, drafted: int, accepted: int, seconds: float) -> None:
        self.stats.add_pass(drafted, accepted)
        # A length's first pass prices it only until its second replaces it: on MLX's CUDA
        # backend the first pass of a length compiles its kernels (hundreds of ms in a fresh
        # process, 5-20 plain steps), and averaged in it would keep `auto` backed off.
        seen = self.passes_of[drafted] = self.passes_of.get(drafted, 0) + 1
        self.pass_s[drafted] = seconds if seen == 2 else _ema(self.pass_s.get(drafted), seconds)
        self.kept = self.kept * _DECAY + accepted
        self.rejected = self.rejected * _DECAY + (1 if accepted < drafted else 0)
