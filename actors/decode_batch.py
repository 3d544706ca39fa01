"""The decode batch: every sequence that is decoding advances in one forward per step.

A trio task of the engine. Sequences (`Row`s) are prefilled alone by their generations,
then join; each asks for its next token (`next`) and the task runs one step for all rows
once every row has asked, so a step's layers demand the union of the rows' experts: each
expert is read and pinned once for the whole batch, and the disk serves every row per
pass. Rows join and leave only between steps (`_regroup`): the decoder is parked (a step
queued on the last tokens is undone exactly), leavers' caches are cut out, newcomers'
merged in (`CacheBatcher`), and a new decoder starts from each row's last token.

A lone sequence keeps its own plain caches and the one-row decoder: alone, a generation
computes exactly what it computed before batching existed. In a batch, each row's tokens
are those it would get alone (its own sampler and RNG stream; the batched kernels give
the same logits up to rounding, see docs/results.md).

Compute turns: the engine's `turn` lock is held for each step and for each prefill
chunk of a newcomer, so prefill and decode interleave, chunk by step (the lock is fair);
a prefill that finds a step queued parks the decoder first (`exclusive`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import structlog
import trio

from actors.batch_regroup import regroup_caches
from actors.compute import Compute
from actors.decode import Decoder
from actors.forward import CacheBatcher
from actors.row_samplers import RowSamplers
from actors.sampler import Sampler
from actors.speculative.decoder import RowSpeculation, SpeculativeDecoder
from actors.speculative.policy import SpeculationPolicy

log = structlog.get_logger("moestream.batch")


@dataclass(eq=False)
class Row:
    """One decoding sequence, as the batch sees it."""

    sampler: Sampler
    cache: list[Any]  # its own caches, while it is not merged into a batch
    logits: mx.array | None  # [vocab]: its first token is still to be drawn from these
    asked: bool = False  # waiting for its next token
    more: int = 1 << 30  # tokens it may still ask for after this one
    leaving: bool = False
    want_cache: bool = False  # its caches are handed back when it leaves
    token: int | None = None
    error: BaseException | None = None
    speculation: RowSpeculation | None = None  # drafts while it decodes alone
    delivered: trio.Event = field(default_factory=trio.Event)
    left: trio.Event = field(default_factory=trio.Event)

    def deliver(self, token: int | None, error: BaseException | None = None) -> None:
        self.asked = False
        self.token, self.error = token, error
        if token is not None and self.speculation is not None:
            self.speculation.seen(token)
        self.delivered.set()


@dataclass
class BatchStats:
    steps: int = 0
    rows_stepped: int = 0  # sum over steps of the batch size
    regroups: int = 0
    largest: int = 0


class DecodeBatch:
    def __init__(self, compute: Compute, caches: CacheBatcher, turn: trio.Lock) -> None:
        self.compute = compute
        self.caches = caches
        self.turn = turn
        self.members: list[Row] = []
        self.joiners: list[Row] = []
        self.decoder: Decoder | SpeculativeDecoder | None = None
        self.cache: list[Any] | None = None  # the members' (merged, when more than one)
        self.prefill_waiting = 0
        self.closed = False
        self.stats = BatchStats()
        self.speculation = SpeculationPolicy()  # the engine sets its own
        # (old caches, new caches, each member's speculation) whenever the members' caches
        # change: the engine feeds its MTP drafters from batched steps (pipeline.speculation).
        self.regrouped: Callable[[list[Any] | None, list[Any] | None,
                                  list[RowSpeculation | None]], None] | None = None
        self._poke = trio.Event()

    @property
    def size(self) -> int:
        return len(self.members)

    def _wake(self) -> None:
        self._poke.set()

    # -- the generations' side ---------------------------------------------------------------

    def join(self, cache: list[Any], sampler: Sampler, logits: mx.array,
             speculation: RowSpeculation | None = None) -> Row:
        """A prefilled sequence: its caches, sampler and last-position logits [vocab];
        with `speculation`, it drafts whenever it decodes alone."""
        row = Row(sampler, cache, logits, speculation=speculation)
        self.joiners.append(row)
        return row

    async def next(self, row: Row, more: int) -> int:
        """`row`'s next token (recorded in its sampler). `more`: how many more it may ask for."""
        if row.leaving:
            raise RuntimeError("next() after leave()")
        row.delivered = trio.Event()
        row.asked, row.more = True, more
        self._wake()
        await row.delivered.wait()
        if row.error is not None:
            raise row.error
        assert row.token is not None
        return row.token

    async def leave(self, row: Row, want_cache: bool) -> list[Any] | None:
        """`row` is done: returns once the batch has let it go (within one step), with its
        caches (every token but the last fed) if `want_cache`. Shielded: a cancelled
        generation still waits, so the engine is clean when it is gone."""
        row.leaving, row.want_cache = True, want_cache
        self._wake()
        with trio.CancelScope(shield=True):
            if not self.closed:
                await row.left.wait()
        return row.cache if want_cache and row.error is None and not self.closed else None

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """A compute turn for something else (a prefill chunk, warming): no step queued."""
        self.prefill_waiting += 1
        try:
            async with self.turn:
                self.prefill_waiting -= 1
                if self.decoder is not None:
                    with trio.CancelScope(shield=True):  # the rows' state must stay whole
                        await self.decoder.park()
                yield
        finally:
            self._wake()

    # -- the task ------------------------------------------------------------------------------

    def _due(self) -> bool:
        if any(r.leaving for r in self.members) or any(r.asked or r.leaving for r in self.joiners):
            return True
        return bool(self.members) and all(r.asked for r in self.members)

    async def run(self) -> None:
        try:
            while True:
                await self._poke.wait()
                self._poke = trio.Event()
                if not self._due():
                    continue
                async with self.turn:
                    tokens = await self._step()
                if tokens is not None:
                    self._deliver(tokens)
        finally:
            # The engine is closing: nobody waits on a batch that will not step again.
            self.closed = True
            closed = RuntimeError("the engine closed")
            for row in [*self.members, *self.joiners]:
                row.deliver(None, closed)
                row.left.set()

    def _deliver(self, tokens: list[int]) -> None:
        # Its own frame: a loop variable in `run` kept the last row (and its model state,
        # 86 MiB at 1024 tokens of the 35B) alive while the task waited for the next
        # request, after the row had left and the prefix cache had let its state go.
        for row, token in zip(self.members, tokens, strict=True):
            row.deliver(token)

    async def _step(self) -> list[int] | None:
        rows = [*self.members, *self.joiners]  # a failed regroup has taken joiners out of both
        try:
            await self._regroup()
            if not self.members or not all(r.asked for r in self.members):
                return None
            assert self.decoder is not None
            more = 0 if self.prefill_waiting or self.joiners else min(r.more for r in self.members)
            tokens = await self.decoder.next(more)
        except Exception as exc:
            # A failed step (a read that kept failing) leaves the rows' state half
            # updated: every row ends with the error, the next request starts clean.
            log.warning("batch.step_failed", rows=len(self.members), error=repr(exc))
            with trio.CancelScope(shield=True):
                await self.compute.router.drain()
            for row in dict.fromkeys([*rows, *self.members, *self.joiners]):
                row.deliver(None, exc)
                row.left.set()
            self.joiners = []
            self._start([], None, None)
            return None
        self.stats.steps += 1
        self.stats.rows_stepped += len(self.members)
        return tokens

    async def _regroup(self) -> None:
        """Apply pending leaves and joins between two steps."""
        leaving = [r for r in self.members if r.leaving]
        joining = [r for r in self.joiners if r.asked and not r.leaving]
        if self.decoder is not None and self.decoder.holds_tokens and not leaving:
            joining = []  # the lone row's drafted tokens go out first (no compute each)
        gone = [r for r in self.joiners if r.leaving]
        self.joiners = [r for r in self.joiners if r not in joining and r not in gone]
        # A leaver is let go only once the engine is idle, if it is the last: a caller that
        # sees its generation end then finds no read in flight and nothing pinned.
        try:
            if not leaving and not joining:
                if gone and not self.members:
                    await self._idle()
                return
            self.stats.regroups += 1
            firsts = await self.compute.on_mlx(self._regroup_mlx, leaving, joining)
            for row, token in firsts:
                row.deliver(token)
            self.stats.largest = max(self.stats.largest, len(self.members))
            if not self.members:
                await self._idle()
        finally:
            for row in [*gone, *leaving]:
                row.left.set()
        log.debug("batch.regroup", rows=len(self.members), left=len(leaving), joined=len(joining))

    async def _idle(self) -> None:
        # Nothing decodes until the next request. The prefetch task may still be ordering
        # reads for a next token that will not come: once its orders are queued, the
        # router lands them and lets the last layer's experts go.
        await self.compute.prefetcher.caught_up()
        await self.compute.router.settle()

    def _regroup_mlx(self, leaving: list[Row], joining: list[Row]) -> list[tuple[Row, int]]:
        """On the MLX thread: park, cut out leavers, draw newcomers' first tokens, merge.

        Returns the first tokens drawn, to deliver on the trio side. The caches regroup in
        `regroup_caches`, which a later pipeline rank runs too (from the rows' ids).
        """
        feed: list[int] = []
        firsts: list[tuple[Row, int]] = []
        if self.decoder is not None:
            self.decoder.park_now()
            if self.decoder.feed is None:  # a lone row that never stepped: logits pending
                assert self.decoder.logits is not None and len(self.members) == 1
                self.members[0].logits = self.decoder.logits[0]
            else:
                feed = list(self.decoder.feed)
        old = self.members
        keep = [i for i, r in enumerate(old) if r not in leaving]
        copies = [i for i, r in enumerate(old) if r in leaving and r.want_cache]
        cache, taken = regroup_caches(self.caches, self.cache, len(old), keep,
                                      [r.cache for r in joining], copies)
        for i, own in taken.items():
            old[i].cache = own
        members = [old[i] for i in keep]
        feed = [feed[i] for i in keep] if feed else []
        if not members and len(joining) == 1:
            # Alone: the one-row decoder draws its first token, as a lone generation does.
            row = joining[0]
            assert row.logits is not None  # a newcomer brings its prefill's last logits
            self._start([row], cache, self._decoder([row], row.cache,
                                                    RowSamplers([row.sampler]),
                                                    logits=row.logits[None]))
            row.logits = None
            return firsts
        # Rows whose first token is still to draw (newcomers; a lone row that never
        # stepped) draw it from their own logits and get it now, as they would alone.
        for row in [*members, *joining]:
            if row.logits is not None:
                token = row.sampler.sample(row.logits)
                row.logits = None
                if row in members:
                    feed = [token]  # the lone row: its only feed
                firsts.append((row, token))
        feed += [token for row, token in firsts if row in joining]
        members += joining
        if not members:
            self._start([], None, None)
            return firsts
        assert cache is not None
        sampler = RowSamplers([r.sampler for r in members])
        self._start(members, cache, self._decoder(members, cache, sampler, feed=feed))
        return firsts

    def _decoder(self, members: list[Row], cache: list[Any], sampler: RowSamplers,
                 **start: Any) -> Decoder | SpeculativeDecoder:
        """A lone row that speculates drafts; a batch of rows decodes plainly."""
        spec = members[0].speculation if len(members) == 1 else None
        if spec is None:
            return Decoder(self.compute, cache, sampler, **start)
        return SpeculativeDecoder(self.compute, cache, sampler, spec, self.speculation, **start)

    def _start(self, members: list[Row], cache: list[Any] | None,
               decoder: Decoder | SpeculativeDecoder | None) -> None:
        if self.regrouped is not None:
            self.regrouped(self.cache, cache, [m.speculation for m in members])
        self.members, self.cache, self.decoder = members, cache, decoder
