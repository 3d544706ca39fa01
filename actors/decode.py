"""Decode, token after token, with the next token's forward queued before this one is read.

With every expert in the pool a decode step is GPU work plus host work (building the
step's graph, reading the token back, the pool's bookkeeping). Resident mlx-lm hides the
host work by queueing step t+1 on the token of step t before reading that token back;
this does the same on top of the run-ahead (`ForwardStep.launch`): step t+1 is built on
the *lazy* token t, and its run-ahead outputs (ids, "all present" flags, logits) and
token t+1 are evaluated asynchronously while the host reads token t and does t's
bookkeeping. One host sync per token, and the GPU never waits for the host.

Speculation is undone exactly:
- a step whose token turns out to end the generation (EOS, stop string, length) is rolled
  back (`close`): the caches are as if it never ran, as the unpipelined loop leaves them;
- a step that missed an expert at layer l is redone from l, one sync per layer, after the
  step queued on it is waited for and rolled back: caches of layers < l as after the
  missing step (those layers had every expert), of layers >= l as before it; the sampler's
  RNG key goes back so the token is redrawn identically.
The pool sees exactly the demand sequence of the unpipelined loop: a step's bookkeeping
happens when its token is consumed, never for a step that is rolled back.

Used only when the sampler can draw lazily (no penalties, grammar or logprobs: they need
the previous token on the host) and the run-ahead policy wants it; otherwise each `next`
is sample + forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from actors.compute import Compute
from actors.forward import ForwardStepper
from actors.sampler import Sampler


@dataclass
class _Launched:
    step: Any  # ForwardStep with launch/restore/snapshot/resume
    lazy: Any  # LazyRunAhead
    token: mx.array  # lazy: drawn from lazy.logits
    key: mx.array  # the sampler's key before that draw


class Decoder:
    def __init__(self, compute: Compute, cache: list[Any], sampler: Sampler, logits: mx.array):
        self.compute = compute
        self.cache = cache
        self.sampler = sampler
        self.logits: mx.array | None = logits  # evaluated, not yet sampled
        self.feed: int | None = None  # sampled, not yet run through the model
        self.launched: _Launched | None = None

    # -- on the MLX thread ------------------------------------------------------------------

    def _launch(self, token: mx.array) -> _Launched:
        """Queue the forward of lazy `token` and the draw of the token after it."""
        c = self.compute
        step = c.model.step(token, self.cache)
        lazy = step.launch(c._slot_map(), c._row_of)
        key = self.sampler.key
        drawn = self.sampler.draw(lazy.logits)
        mx.async_eval(drawn, *lazy.arrays())
        c.stats.run_ahead_tokens += 1
        return _Launched(step, lazy, drawn, key)

    def _start(self, logits: mx.array, more: bool) -> tuple[int, _Launched | None]:
        token = self.sampler.draw(logits)
        launched = self._launch(token) if more else None
        return int(token.item()), launched

    def _step(self, current: _Launched, more: bool) -> tuple[Any, int, _Launched | None]:
        """Queue the next step, then read this one: its routing, flags and token (the
        token is meaningless when the step missed; reading it costs nothing more)."""
        launched = self._launch(current.token) if more else None
        return current.lazy.result(), int(current.token.item()), launched

    def _undo_next(self, current: _Launched, nxt: _Launched | None, miss: int) -> None:
        """`current` missed at `miss`: wait for `nxt` (queued on a wrong token), undo it."""
        if nxt is not None:
            mx.eval(nxt.token, *nxt.lazy.arrays())
            current.step.restore(nxt.step.snapshot(), range(0, miss))
        self.sampler.restore_key(current.key)

    def _rollback(self, launched: _Launched) -> None:
        mx.eval(launched.token, *launched.lazy.arrays())
        launched.step.restore(launched.step.snapshot(), range(len(self.cache)))

    # -- on the trio side -------------------------------------------------------------------

    async def next(self, more: bool) -> int:
        """The next token (recorded in the sampler). `more`: another may be wanted after it."""
        c = self.compute
        if self.launched is not None:
            return await self._consume(self.launched, more)
        if self.feed is not None:
            self.logits = await c.forward([self.feed], self.cache, "decode")
            self.feed = None
        assert self.logits is not None
        logits, self.logits = self.logits, None
        if more and self.sampler.lazy_ok and c.run_ahead.ready():
            token, self.launched = await c._mlx(self._start, logits, True)
        else:
            token = await c._mlx(self.sampler.sample, logits)
            self.feed = token
            return token
        self.sampler.record(token)
        return token

    async def _consume(self, current: _Launched, more: bool) -> int:
        c = self.compute
        result, token, nxt = await c._mlx(self._step, current, more)
        await c.begin_token("decode")
        miss = await c.account(result, "decode")
        c.run_ahead.after_run_ahead(hit=miss is None)
        if miss is None:
            self.sampler.record(token)
            self.launched = nxt
            if nxt is None:
                self.feed = token
            return token
        self.launched = None
        await c._mlx(self._undo_next, current, nxt, miss)
        step: ForwardStepper = current.step
        logits = await c.finish_from(step, miss, "decode")
        token = await c._mlx(self.sampler.sample, logits)
        self.feed = token
        return token

    async def close(self) -> None:
        """Undo a step queued on a token that was never consumed (the generation ended)."""
        if self.launched is not None:
            launched, self.launched = self.launched, None
            await self.compute._mlx(self._rollback, launched)
