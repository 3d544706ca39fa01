"""Whether a draft is worth a verify pass, and how long it may be.

`ngram` / `mtp`: always draft, up to `max_draft` tokens. `auto` decides from what it
measures on this engine: the seconds of a plain decode step, the seconds of a verify
pass of each draft length (reads, recompute of the DeltaNet states and acceptance
included), and the acceptance a per drafted token (accepted / (accepted + rejections):
the estimate of a geometric acceptance). A pass of k drafts gives E(k) = 1 + a + ... +
a^k tokens, so it pays when E(k) x plain > pass(k). When no length pays (the cost of a
pass outgrows its tokens: a pool that misses, a text that does not repeat) it stops
speculating and probes one short pass now and then, at intervals that double while it
keeps losing and are never shorter than the last probe's loss over 2 % of a plain
step, so its loss stays a small fraction of plain decode.

Shadow drafts. At a plain step the drafter is asked too, and its first token compared
with the token the step gives: a trial of the acceptance that costs no pass (for a
sampled row, the chance that they agree is p(draft), the chance that speculative
sampling would keep it). Prompt lookup costs a few dictionary look-ups and is asked at
every plain step; an MTP head runs its layer to answer, so it is asked at each
generation's first token (a new text; where that costs within 2 % of the generation's
plain decode) and then only when a trial is due (at the probes' intervals, at least its
cost over 2 % of a plain step apart). The first trial is the
first token's (drawn from the prompt's logits, never a pass), and no pass is tried
while the trials say that even a pass as cheap as a plain step could not pay (a = 0: a
pass gives one token). On MLX's CPU a pass of 2 positions costs ~1.8 plain steps, and
the first pass and two probes of a random-weight MTP head cost 16 % of a 48-token
decode (the project VM, session 28). While backed off, trials keep the acceptance
current, so a text that starts to repeat resumes speculation without waiting for a
probe pass.

The guard: a pass of k drafts pins up to (k + 1) x top_k experts per MoE layer, so k is
cut to what the pool can pin (`pinnable_rows` - 1), never a failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import structlog

SpeculativeMode = Literal["auto", "mtp", "ngram", "off"]

log = structlog.get_logger("moestream.speculative")

_ALPHA = 0.2  # weight of the newest measurement (costs)
_DECAY = 0.95  # per pass, of the acceptance counts (about the last 20 passes)
_PROBE_FIRST, _PROBE_MAX = 8, 512  # plain steps between probes while losing
_PROBE_BUDGET = 0.02  # a probe's loss, as a share of the plain decode between probes
# Shadow trials before a shadowed row's first pass: one, at the first token (drawn from
# the prompt's logits, never a pass), so where drafts hit the first pass comes as early as
# without trials (a cold 24-token run lost 15 % on the VM waiting for two).
_SHADOW_FIRST = 1
Shadow = Literal["free", "costly"]
# Tokens a pass must be expected to give, in plain steps, for any pass to be worth trying:
# the cheapest 2-position pass measured costs ~1.27 plain steps (resident mlx-lm on CUDA,
# benchmarks/verify_cost.py; on MLX's CPU ~1.8), so a pass needs a >= ~0.2 to have a chance.
_WORTH = 1.2
_COMPILED = 3.0  # a first pass dearer than this many plain steps may have compiled kernels


@dataclass
class SpecStats:
    passes: int = 0  # verify passes
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # ... of them kept
    pass_tokens: int = 0  # tokens the passes gave (the drafts kept, one more each)
    plain_steps: int = 0  # decode steps of speculating rows that had no draft
    backoffs: int = 0  # times `auto` stopped speculating
    shadowed: int = 0  # plain steps whose token a shadow draft was compared with

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
    trial_s: float | None = None  # seconds of a costly drafter's shadow draft
    _losing: bool = False
    _shadow_due: bool = False  # a costly drafter is to be asked at the next plain step
    _wait: int = _PROBE_FIRST  # plain steps to the next probe (or trial, where hopeless)
    _waited: int = 0  # plain steps since the last probe (or trial) was due
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

    def draft_len(self, mode: str, room: int, shadow: Shadow | None = None) -> int:
        """Drafts to ask for at the next step; `room`: tokens the row may still take - 1;
        `shadow`: the row's drafter is asked at plain steps too, at every one where it
        is free, where `shadow_wanted` says where it is costly (`after_shadow`)."""
        k = min(self.longest, room)
        if k < 1 or mode == "off":
            return 0
        if mode != "auto":
            return k
        if shadow is not None and not self.pass_s and self.stats.shadowed < _SHADOW_FIRST:
            self._shadow_due = True
            return 0  # plain steps and trials before the first pass
        if shadow is not None and 1.0 + self.acceptance < _WORTH:
            # No pass could pay, even one as cheap as a plain step (a = 0: one token a
            # pass): only trials, a costly drafter's now and then, until they hit. After
            # passes, that is speculation stopping too, as a losing pass's back-off is.
            if self.pass_s and not self._losing:
                self._stop()
            self._shadow_due = self._probe_due(shadow=True)
            return 0
        if not self.pass_s:
            # Measure the cheapest pass first: where drafts lose (a text that does not
            # repeat, compute that costs per position) the probe costs least; where they
            # pay, longer ones are tried next (priced as the nearest measured: `_best`).
            return 1
        if self.plain_s is None:
            return 0  # ... then a plain step
        best, gain = self._best(k)
        if gain >= 1.0:
            # Paying again, from a back-off or after trials that had doubled the wait
            # (`_probe_due(shadow=True)`): a later back-off probes soon again.
            self._losing, self._probe_every = False, _PROBE_FIRST
            return best
        if not self._losing:
            self._probe_every = max(self._probe_every, self._probe_floor())
            self._wait, self._waited = self._probe_every, 0
            self._stop()
        # A probe: one short pass now and then, to see whether the regime changed.
        return 1 if self._probe_due() else 0

    def _stop(self) -> None:
        """Speculation stops (a back-off): counted and logged once, until passes pay again."""
        self._losing = True
        self.stats.backoffs += 1
        log.info("speculative.backoff", acceptance=round(self.acceptance, 3),
                 plain_ms=None if self.plain_s is None else round(self.plain_s * 1e3, 2),
                 probe_every=self._probe_every,
                 pass_ms={n: round(s * 1e3, 2) for n, s in sorted(self.pass_s.items())})

    def _probe_due(self, shadow: bool = False) -> bool:
        """One plain step nearer the next probe (a pass, or where `shadow`, a costly
        drafter's trial); True when it is due. The one after it waits twice as long, and
        each at least its floor (`_probe_floor`, `_trial_floor`), priced again when due."""
        self._waited += 1
        if self._wait > 0:
            self._wait -= 1
            return False
        floor = self._trial_floor() if shadow else self._probe_floor()
        if self._waited <= floor:  # dearer than when it was scheduled: wait out the rest
            self._wait = floor - self._waited
            return False
        self._waited = 0
        self._wait = self._probe_every = min(max(self._probe_every * 2, floor), _PROBE_MAX)
        return True

    def _probe_floor(self) -> int:
        """Plain steps between probes so that a probe's loss (its pass against the plain
        steps its tokens would have taken) stays within `_PROBE_BUDGET` of them. A
        length's first pass costing over `_COMPILED` plain steps may have compiled
        (`after_pass`): the next probe then comes soon, to see the steady price."""
        assert self.plain_s is not None, "priced only once plain decode is"
        cost = self.pass_s.get(1)
        if cost is None or (self.passes_of.get(1, 0) < 2 and cost > _COMPILED * self.plain_s):
            return _PROBE_FIRST
        loss = cost - (1.0 + self.acceptance) * self.plain_s
        return max(_PROBE_FIRST, min(_PROBE_MAX, math.ceil(loss / (_PROBE_BUDGET * self.plain_s))))

    def _trial_floor(self) -> int:
        """Plain steps between a costly drafter's trials: its cost within `_PROBE_BUDGET`."""
        if self.trial_s is None or self.plain_s is None:
            return _PROBE_FIRST
        return max(_PROBE_FIRST, min(_PROBE_MAX, math.ceil(self.trial_s / (_PROBE_BUDGET * self.plain_s))))

    def quiet(self) -> bool:
        """Whether the next plain step will ask for no draft unless a trial changes the
        acceptance: backed off (or hopeless after the first trial) with its next probe or
        trial not yet due. The decoder then queues a second step as plain decode does
        (`compute.decode_ahead`); a pass that comes after all undoes it."""
        hopeless = self.stats.shadowed >= _SHADOW_FIRST and 1.0 + self.acceptance < _WORTH
        return (self._losing or hopeless) and self._wait >= 1

    def shadow_wanted(self, free: bool) -> bool:
        """Whether to ask the drafter at this plain step: always where it is `free`, else
        for the first trial and when a trial is due."""
        return free or self._shadow_due

    def new_text_trial(self, left: int) -> bool:
        """Whether a costly drafter is tried at a new generation's first token, however
        long the engine's trials wait: where that trial costs within `_PROBE_BUDGET` of the
        generation's plain decode (`left` tokens), or is not priced yet. A short
        generation skips it (H200, session 31: an MTP trial at each 32-token generation's
        start cost 5-7 %, `auto` at 0.93 / 0.95x plain); the due trials still come."""
        if self.trial_s is None or self.plain_s is None:
            return True
        return self.trial_s <= _PROBE_BUDGET * self.plain_s * left

    def after_shadow(self, kept: bool, seconds: float | None = None) -> None:
        """A shadow draft's first token was (`kept`) or was not the token a plain step gave;
        `seconds`: what asking a costly drafter took."""
        self._shadow_due = False
        if seconds is not None:
            self.trial_s = _ema(self.trial_s, seconds)
        self.stats.shadowed += 1
        self.kept = self.kept * _DECAY + (1 if kept else 0)
        self.rejected = self.rejected * _DECAY + (0 if kept else 1)

    def _best(self, k: int) -> tuple[int, float]:
        assert self.plain_s is not None
        a = self.acceptance
        out = (0, 0.0)
        # A length whose one pass cost over `_COMPILED` plain steps, and over twice what a
        # steady length's price scaled to its positions says, may have compiled its kernels
        # (`after_pass`): priced as unmeasured, or it would never get the second pass that
        # prices it (only length 1 is probed). A pass that costs in proportion (MLX's CPU,
        # where compute grows with the positions) is a price, not a compile.
        steady = {n: s for n, s in self.pass_s.items() if not self._compiled(n, s)} or self.pass_s
        for n in range(1, k + 1):
            # A length not measured yet costs what the nearest measured one did (so a
            # longer draft is tried once it may pay, and then measured).
            cost = steady.get(n) or steady[min(steady, key=lambda m: abs(m - n))]
            tokens = sum(a**i for i in range(n + 1))
            gain = tokens * self.plain_s / cost
            if gain > out[1]:
                out = (n, gain)
        return out

    def _compiled(self, n: int, seconds: float) -> bool:
        assert self.plain_s is not None
        if self.passes_of.get(n, 0) != 1 or seconds <= _COMPILED * self.plain_s:
            return False
        priced = {m: c for m, c in self.pass_s.items() if m != n and self.passes_of.get(m, 0) >= 2}
        if not priced:
            return True
        m = min(priced, key=lambda m: abs(m - n))
        return seconds > 2 * priced[m] * (n + 1) / (m + 1)

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
