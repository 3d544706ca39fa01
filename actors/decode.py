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

Where the host is what a token waits for (every expert pooled: on the H100 the GPU was
busy 6 ms of a 37 ms token, session 33, docs/results.md), the host's bookkeeping of token
t (pool, prefetcher, text) ran in series with the MLX thread's building of step t+2. With
every expert ready and nothing likely to undo queued steps (a lone row, not speculating or
with `auto` backed off: actors/speculative/decoder.py), a second step is queued as soon as
a step is read, by a job of its own on the MLX thread, so that building runs while the
event loop does the bookkeeping (`compute.decode_ahead`).
A miss cannot happen there; a generation's end or a park undoes both queued steps.

The decoder works on rows: one sequence, or a batch whose caches were merged
(`DecodeBatch`); every token is a list with one id per row, and each row has its own
sampler (`RowSamplers`). `park` undoes a queued step and leaves each row's last token to
be fed, so rows can join or leave between two steps.

Used only when every row's sampler can draw lazily (no penalties, grammar or logprobs: they need
the previous token on the host) and the run-ahead policy wants it; otherwise each `next`
is sample + forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx

from actors.compute import Compute
from actors.forward import ForwardStepper
from actors.mx_typed import int_list
from actors.row_samplers import RowSamplers


@dataclass
class _Launched:
    step: Any  # ForwardStep with launch/restore/snapshot/resume
    lazy: Any  # LazyRunAhead
    tokens: mx.array  # lazy [rows]: drawn from lazy.logits
    key: list[mx.array]  # the samplers' keys before that draw


def rows_of(tokens: mx.array) -> mx.array:
    """Lazy token ids [rows] as the model's [rows, 1] input: one decode token per row."""
    return tokens.reshape(-1, 1)


class Decoder:
    holds_tokens = False  # tokens drawn ahead of `next` (actors/speculative/decoder.py)

    def __init__(self, compute: Compute, cache: list[Any], sampler: RowSamplers,
                 logits: mx.array | None = None, feed: list[int] | None = None,
                 ahead_ok: bool = True):
        """Start from `logits` ([rows, vocab], evaluated, not yet sampled) or from `feed`
        (a token per row, sampled and recorded, not yet run through the model).
        `ahead_ok`: a second step may be queued (see the module's docstring)."""
        self.compute = compute
        self.cache = cache
        self.sampler = sampler
        self.logits: mx.array | None = logits
        self.feed: list[int] | None = feed
        self.launched: _Launched | None = None
        # The step queued on `launched`'s tokens by a job of its own (depth two), or the
        # error that job met; both only ever touched on the MLX thread.
        self.ahead: _Launched | None = None
        self._ahead_error: BaseException | None = None
        self.ahead_ok = ahead_ok
        self.last: list[int] | None = None  # the tokens `next` returned last

    # -- on the MLX thread ------------------------------------------------------------------

    def _launch(self, tokens: mx.array) -> _Launched:
        """Queue the forward of lazy `tokens` and the draw of the tokens after them."""
        c = self.compute
        step = c.model.step(rows_of(tokens), self.cache)
        lazy = step.launch(c._slot_map())
        key = self.sampler.key
        drawn = self.sampler.draw(lazy.logits)
        mx.async_eval(drawn, *lazy.arrays())
        c.stats.run_ahead_tokens += 1
        return _Launched(step, lazy, drawn, key)

    def _start(self, logits: mx.array, more: bool) -> tuple[list[int], _Launched | None]:
        tokens = self.sampler.draw(logits)
        launched = self._launch(tokens) if more else None
        return int_list(tokens), launched

    def _step(self, current: _Launched, more: int) -> tuple[Any, list[int], _Launched | None]:
        """Queue the next step (unless queued already), then read this one: its routing,
        flags and tokens (the tokens are meaningless when the step missed; reading them
        costs nothing more); after a hit, where it may, queue the one after (`_may_queue_ahead`).
        A model that reads its tokens on the host waits for this step's anyway: then this
        one is read first and the next queued only after a hit (a miss would waste it)."""
        if self.compute.model.tokens_on_host:
            result = current.lazy.result()
            launched = self._launch(current.tokens) if more and result.first_miss() is None else None
            return result, int_list(current.tokens), launched
        launched = self._take_ahead()
        if launched is None and more:
            launched = self._launch(current.tokens)
        result = current.lazy.result()
        if launched is not None and more > 1 and result.first_miss() is None and self._may_queue_ahead():
            self.compute.worker.submit(partial(self._launch_ahead, launched))
        return result, int_list(current.tokens), launched

    def _may_queue_ahead(self) -> bool:
        """A second step may be queued: nothing will undo it but an end or a park (a lone
        row, every expert ready: no miss, no install under it; `ahead_ok`: no speculation,
        or `auto` backed off, whose probe pass parks both)."""
        c = self.compute
        return self.ahead_ok and c.decode_ahead and len(self.sampler) == 1 and c._slot_map().complete

    def _launch_ahead(self, launched: _Launched) -> None:
        """A job of its own on the MLX thread: queue the step after `launched`."""
        try:
            self.ahead = self._launch(launched.tokens)
            self.compute.stats.ahead_steps += 1  # only ever counted on the MLX thread
        except BaseException as exc:  # the next step or park reports it
            self._ahead_error = exc

    def _take_ahead(self) -> _Launched | None:
        """The step queued by `_launch_ahead` (None if none); raises what it met."""
        error, self._ahead_error = self._ahead_error, None
        if error is not None:
            raise error
        ahead, self.ahead = self.ahead, None
        return ahead

    def _undo_next(self, current: _Launched, nxt: _Launched | None, miss: int) -> None:
        """`current` missed at `miss`: wait for `nxt` (queued on wrong tokens), undo it."""
        if nxt is not None:
            mx.eval(nxt.tokens, *nxt.lazy.arrays())
            current.step.restore(nxt.step.snapshot(), range(0, miss))
        self.sampler.restore_key(current.key)

    def _rollback(self, launched: _Launched) -> None:
        mx.eval(launched.tokens, *launched.lazy.arrays())
        launched.step.restore(launched.step.snapshot(), range(len(self.cache)))
        self.sampler.restore_key(launched.key)  # its draw is made again, identically

    # -- on the trio side -------------------------------------------------------------------

    async def next(self, more: int) -> list[int]:
        """The next token of every row (recorded in the samplers). `more`: how many more
        tokens may be wanted after this one (0: nothing is queued behind it)."""
        tokens = await self._next(more)
        self.last = tokens
        return tokens

    async def _next(self, more: int) -> list[int]:
        c = self.compute
        if self.launched is not None:
            return await self._consume(self.launched, more)
        if self.feed is not None:
            self.logits = await c.forward([[t] for t in self.feed], self.cache, "decode")
            self.feed = None
        assert self.logits is not None
        logits, self.logits = self.logits, None
        if more and self.sampler.lazy_ok and c.run_ahead.ready():
            tokens, self.launched = await c.on_mlx(self._start, logits, True)
        else:
            tokens = await c.on_mlx(self.sampler.sample, logits)
            self.feed = tokens
            return tokens
        self.sampler.record(tokens)
        return tokens

    async def _consume(self, current: _Launched, more: int) -> list[int]:
        c = self.compute
        result, tokens, nxt = await c.on_mlx(self._step, current, more)
        await c.begin_token("decode")
        miss = await c.account(result, "decode")
        c.run_ahead.after_run_ahead(hit=miss is None)
        if miss is None:
            self.sampler.record(tokens)
            self.launched = nxt
            if nxt is None:
                self.feed = tokens
            return tokens
        self.launched = None
        await c.on_mlx(self._undo_next, current, nxt, miss)
        # Neither the undone step nor this step's run-ahead outputs are read again: let
        # their states go before the per-layer redo (else held through it, two model
        # states: 128 MiB at the 35B's dimensions).
        nxt = None
        current.lazy = None
        step: ForwardStepper = current.step
        logits = await c.finish_from(step, miss, "decode")
        tokens = await c.on_mlx(self.sampler.sample, logits)
        self.feed = tokens
        return tokens

    def park_now(self) -> None:
        """Undo a step queued on the last tokens (on the MLX thread): the caches hold
        every token but the last, which is left in `feed` (rows may then join or leave; a
        generation that ends leaves its caches as the prefix cache expects)."""
        if self.launched is not None:
            launched, self.launched = self.launched, None
            self._ahead_error = None  # a failed second step: the caches go back below anyway
            ahead, self.ahead = self.ahead, None
            if ahead is not None:  # queued on `launched`: waited for, undone with it
                mx.eval(ahead.tokens, *ahead.lazy.arrays())
            self._rollback(launched)
            self.feed = self.last

    async def park(self) -> None:
        if self.launched is not None:
            await self.compute.on_mlx(self.park_now)
