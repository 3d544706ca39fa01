"""The lone sequence's decoder with drafts: one verify pass, several tokens.

Wraps the plain `Decoder` (pipelined, run-ahead): a step without a draft is its step.
With a draft d1 .. dk (the policy's length, the row's room), a step queued on the last
token is parked (undone exactly), [last, d1 .. dk] goes through one verify pass, the
row's sampler draws each position's token in order (`accept`), and the caches are kept
to the positions the tokens used (`VerifyStepper.keep`). The pass's tokens are then
handed out one per `next`, with their log-probabilities, so the generation sees them as
it sees plain decode's: its stop strings, max_tokens and cancellation act per token.

While tokens are held, the caches are ahead of what was handed out; `park_now` (the row
leaves, or the batch regroups) keeps only the positions of the tokens handed out, so a
generation that stops in the middle of a pass leaves the caches plain decode leaves
(prompt + generated[:-1], what the prefix cache stores). The batch lets newcomers join
only once the held tokens are out (`holds_tokens`): the row's sampler has already drawn
them, and a row that goes on in a batch must not draw them again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from actors.compute import Compute
from actors.decode import Decoder
from actors.row_samplers import RowSamplers
from actors.speculative.accept import Verdict, accept
from actors.speculative.policy import Shadow, SpecStats, SpeculationPolicy
from actors.speculative.verify import MakeVerifyStep, VerifyStepper, verify_pass
from actors.token_logprob import TokenLogprob


class Drafter(Protocol):
    on_mlx: bool  # `propose` runs MLX work (an MTP head): called on the MLX thread

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...


@runtime_checkable
class StreamingDrafter(Protocol):
    """A drafter that reads experts between its MLX calls (the MTP head, its experts
    streamed): it runs its MLX work itself, through `on_mlx` (`Compute.on_mlx`)."""

    def extend(self, tokens: Iterable[int]) -> None: ...

    async def draft(self, k: int, on_mlx: Callable[..., Awaitable[Any]]) -> list[int]: ...


@dataclass
class RowSpeculation:
    """One generation's speculation: its mode, drafter and the tokens it may still take."""

    mode: str  # "auto", "ngram" or "mtp" (never "off": then there is none)
    drafter: Drafter | StreamingDrafter  # has seen the prompt and every token the row was given
    left: int  # tokens the row may still be given
    verify_step: MakeVerifyStep  # the model's verify pass
    stats: SpecStats = field(default_factory=SpecStats)  # this row's passes
    # `auto` has compared this row's drafter with a token of its own: a new text is tried
    # once, whatever the engine's policy learnt from the texts before (a costly drafter
    # where the trial fits the generation: `SpeculationPolicy.new_text_trial`).
    tried: bool = False
    # Where the row's final hidden states go, from every forward it is in (its own and a
    # decode batch's): an MTP drafter's `sink` (position after the forward, h [1, T, H]).
    sink: Callable[[int, Any], None] | None = None

    def seen(self, token: int) -> None:
        self.left -= 1
        self.drafter.extend([token])


class SpeculativeDecoder:
    def __init__(self, compute: Compute, cache: list[Any], sampler: RowSamplers,
                 spec: RowSpeculation, policy: SpeculationPolicy,
                 logits: mx.array | None = None, feed: list[int] | None = None) -> None:
        assert len(sampler) == 1, "speculation decodes one row"
        # One step queued at a time, as a pass undoes what is queued; two where `auto` has
        # backed off (`SpeculationPolicy.quiet`), set before each plain step.
        self.inner = Decoder(compute, cache, sampler, logits=logits, feed=feed, ahead_ok=False)
        self.compute, self.cache, self.sampler = compute, cache, sampler
        self.spec, self.policy = spec, policy
        self._held: list[tuple[int, tuple[TokenLogprob, ...]]] = []
        self._pass: VerifyStepper | None = None
        self._given = 0  # of the last pass's tokens, handed out

    # What the batch reads and sets, as on a plain decoder.
    @property
    def feed(self) -> list[int] | None:
        return self.inner.feed

    @property
    def logits(self) -> mx.array | None:
        return self.inner.logits

    @property
    def holds_tokens(self) -> bool:
        return bool(self._held)

    async def next(self, more: int) -> list[int]:
        if self._held:
            return self._give()
        inner = self.inner
        shadow: Shadow | None = None
        if self.spec.mode == "auto":
            shadow = "free" if self._free() else "costly"
        k = 0 if inner.logits is not None else self.policy.draft_len(self.spec.mode, self.spec.left - 1,
                                                                       shadow)
        draft = await self._propose(k)
        if not draft:
            # A shadow draft: what the drafter would have proposed, against the token the
            # step gives (a trial of the acceptance without a pass: actors/speculative/policy.py).
            guess: list[int] = []
            trial_s: float | None = None  # what asking a costly drafter took
            if (shadow is not None and not k and self.spec.left > 1
                    and (self.policy.shadow_wanted(shadow == "free")
                         or not self.spec.tried and self.policy.new_text_trial(self.spec.left))):
                asked = time.perf_counter()
                guess = await self._propose(1)
                self.spec.tried = self.spec.tried or bool(guess)
                if shadow == "costly":
                    trial_s = time.perf_counter() - asked
            stepped = inner.logits is None  # the first token is drawn from logits at hand
            queued = inner.launched is not None
            inner.ahead_ok = self.spec.mode == "auto" and self.policy.quiet()
            t0 = time.perf_counter()
            tokens = await inner.next(more)
            if guess and tokens:
                self.policy.after_shadow(guess[0] == tokens[0], trial_s)
            if stepped:
                self.spec.stats.plain_steps += 1
                # `auto` prices passes against plain decode as it runs: a step queued
                # behind the last (pipelined), or none at all (layer by layer). The step
                # that restarts the pipeline after a pass runs a forward and queues the
                # next, so it costs more than either: priced as plain, it made passes look
                # cheap (H200, session 15: `auto` at 0.83-0.84x plain).
                steady = queued or inner.launched is None
                self.policy.after_plain(time.perf_counter() - t0 if steady else None)
            return tokens
        t0 = time.perf_counter()
        await inner.park()  # a step queued on the last token: undone, its token is the feed
        assert inner.feed is not None
        logits, step = await verify_pass(self.compute, self.spec.verify_step,
                                         [inner.feed[0], *draft], self.cache)
        verdict: Verdict = await self.compute.on_mlx(self._accept, logits, step, draft)
        self.policy.after_pass(len(draft), verdict.accepted, time.perf_counter() - t0)
        self.spec.stats.add_pass(len(draft), verdict.accepted)
        self._held = list(zip(verdict.tokens, verdict.logprobs, strict=True))
        self._pass, self._given = step, 0
        inner.feed = None  # the next tokens come from `_held`
        return self._give()

    def _free(self) -> bool:
        """Whether the drafter costs nothing to ask (no MLX work, no reads: prompt lookup)."""
        drafter = self.spec.drafter
        return not isinstance(drafter, StreamingDrafter) and not drafter.on_mlx

    async def _propose(self, k: int) -> list[int]:
        drafter = self.spec.drafter
        if not k:
            return []
        if isinstance(drafter, StreamingDrafter):
            return await drafter.draft(k, self.compute.on_mlx)
        return await self.compute.on_mlx(drafter.propose, k) if drafter.on_mlx else drafter.propose(k)

    def _accept(self, logits: mx.array, step: VerifyStepper, draft: list[int]) -> Verdict:
        verdict = accept(self.sampler.samplers[0], logits, draft)
        if verdict.accepted < len(draft):
            step.keep(verdict.accepted + 1)  # the last token and the drafts kept
        return verdict

    def _give(self) -> list[int]:
        token, logprobs = self._held.pop(0)
        self._given += 1
        self.sampler.samplers[0].give_logprobs(logprobs)
        self.inner.last = [token]
        if not self._held:
            self.inner.feed, self._pass = [token], None
        return [token]

    def park_now(self) -> None:
        """On the MLX thread, before the batch regroups: nothing queued, nothing held; the
        caches hold every token handed out but the last, which is the feed."""
        if self._held:
            assert self._pass is not None
            self._pass.keep(self._given)
            self._held, self._pass = [], None
            self.inner.feed = self.inner.last
        self.inner.park_now()

    async def park(self) -> None:
        """No step queued (a prefill turn); held tokens stay held, the caches match them."""
        await self.inner.park()
