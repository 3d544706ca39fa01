"""One generation: prefill, then decode token by token, streaming text.

Its body runs as a job of the engine's compute task; the caller's task only reads the
events (`run`).

Owns the request's sampler, detokenizer, stop matcher and model state. If it is
cancelled or fails mid-way, its model state is discarded (a half-updated recurrent
state is useless) and the reads in flight are drained, so the next generation starts
from a clean pool; the pool's contents stay valid and keep serving as a cache.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import mlx.core as mx
import msgspec
import structlog
import trio

from actors import timeline
from actors.compute_task import Job
from actors.sampler import Sampler, prompt_logprobs
from actors.sampling_params import SamplingParams
from actors.text_stream import TextStream
from actors.token_logprob import TokenLogprob
from pipeline import speculation
from pipeline.container_damage import explain
from pipeline.engine_core import EngineCore
from pipeline.engine_parts import detokenizer
from pipeline.engine_sizing import smallest_workable_slots
from pipeline.events import Done, Event, FinishReason, TextDelta
from pipeline.generation_stats import GenerationMeasure

log = structlog.get_logger("moestream.generation")


def _score_chunk(every: mx.array, targets: list[int], top: int) -> tuple[list[TokenLogprob], mx.array]:
    """On the MLX thread: a chunk's prompt log-probabilities and its last position's logits."""
    scored = prompt_logprobs(every[: len(targets)], targets, top) if targets else []
    return scored, every[-1]


class PromptTooLong(ValueError):
    pass


class Generation:
    def __init__(
        self,
        core: EngineCore,
        tokens: list[int],
        params: SamplingParams,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> None:
        self.core = core
        self.on_prefill = on_prefill  # (tokens done, tokens to do) after each chunk
        self.admitted: trio.Event | None = None  # set when the job starts (left the queue)
        self.tokens = tokens
        self.params = params
        self.started = False
        self.closed = False
        self.job: Job | None = None
        self.cache_seen: list[Any] | None = None  # an MTP drafter follows it while it runs

    def check(self) -> None:
        """Refuse what cannot run before taking the engine's lock."""
        limit = self.core.facts.context_limit
        if not self.tokens:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(self.tokens) >= limit:
            raise PromptTooLong(
                f"prompt has {len(self.tokens)} tokens; the context limit is {limit} "
                f"(prompt + completion), so at most {limit - 1} prompt tokens fit"
            )
        vocab = self.core.facts.vocab_size
        bad = next((t for t in self.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        self.params.check_vocab(vocab)
        speculation.check(self.core, self.params)

    def state_bytes(self) -> int:
        """The most model state this generation can grow to (batch admission)."""
        return self.core.model.state_bytes(len(self.tokens) + self._max_tokens())

    def _max_tokens(self) -> int:
        room = self.core.facts.context_limit - len(self.tokens)
        wanted = self.params.max_tokens if self.params.max_tokens is not None else room
        return max(0, min(wanted, room))

    async def _prefill(self, cache: list[Any], start: int) -> mx.array:
        core = self.core
        compute, batch = core.compute, core.batch
        # All prompt tokens but the last, then the last one alone; checkpoints of the state
        # (see PrefixCache.wants) let a prompt sent again, extended, or sharing a long
        # start with this one restart from there. One chunk per compute turn: while other
        # sequences decode, chunks are capped so their steps come between (no starving).
        # The last chunk and the last token go through the layers together where the
        # model can pair them and their experts fit the pool pinned at once
        # (actors/pair_step.py): each layer's experts read once.
        end = len(self.tokens) - 1
        prefixes = core.prefix_cache
        i = start
        while i < end:
            async with batch.exclusive():
                chunk = core.facts.prefill_chunk
                if batch.size:
                    chunk = min(chunk, core.config.compute.batch_prefill_chunk)
                part = self.tokens[i : min(i + chunk, end)]
                facts = core.facts
                if i + len(part) == end and smallest_workable_slots(
                        facts.num_experts, facts.top_k, len(part) + 1) <= facts.slots:
                    with timeline.span("compute", "prefill-chunk", tokens=len(part) + 1):
                        logits = await compute.forward_pair(
                            part, self.tokens[end], cache, prefixes.piecewise(self.tokens[:end], cache))
                    if logits is not None:
                        if self.on_prefill is not None:
                            self.on_prefill(end, end + 1)
                        return logits
                with timeline.span("compute", "prefill-chunk", tokens=len(part)):
                    await compute.forward(part, cache, "prefill")
            i += len(part)
            if prefixes.wants(i - len(part), i, end):
                await core.worker.run(prefixes.checkpoint, self.tokens[:i], cache)
            if self.on_prefill is not None:
                self.on_prefill(i, end + 1)
        async with batch.exclusive():
            with timeline.span("compute", "prefill-chunk", tokens=1):
                return await compute.forward(self.tokens[end:], cache, "prefill")

    async def _prefill_scored(self, cache: list[Any]) -> tuple[mx.array, tuple[TokenLogprob, ...]]:
        """Prefill keeping every position's logits: the log-probability of each prompt
        token after the first (`SamplingParams.prompt_logprobs`). Chunks of at most 256
        tokens bound the [tokens, vocab] logits held at once."""
        compute, worker = self.core.compute, self.core.worker
        chunk = min(self.core.facts.prefill_chunk, 256)
        top = self.params.prompt_logprobs or 0
        entries: list[TokenLogprob] = []
        logits = None
        for i in range(0, len(self.tokens), chunk):
            part = self.tokens[i : i + chunk]
            async with self.core.batch.exclusive():
                with timeline.span("compute", "prefill-chunk", tokens=len(part)):
                    every = await compute.forward(part, cache, "prefill", all_positions=True)
            targets = self.tokens[i + 1 : i + 1 + len(part)]  # the last position has none
            scored, logits = await worker.run(_score_chunk, every, targets, top)
            entries += scored
        assert logits is not None
        return logits, tuple(entries)

    def submit(self) -> None:
        """Queue this generation now (it runs once admitted, whether or not anyone reads
        yet); `run` reads it. Its events are buffered up to max_tokens + a few, so a row
        whose reader lags never holds up the rest of the decode batch."""
        if self.job is not None:
            return
        self._send, self._receive = trio.open_memory_channel[Event](self._max_tokens() + 8)
        send = self._send
        job = Job(body=lambda: self._body(send), cost=self.state_bytes(), unrun=send.close)
        self.core.compute_task.submit(job)  # a closed engine refuses it: nothing to undo then
        self.job = job
        self.core.waiting += 1

    async def run(self) -> AsyncGenerator[Event, None]:
        """Submit (if not yet) and stream what the generation produces.

        Leaving early (a break, a cancel, a client gone) cancels the job and waits for it
        to clean up, so the engine is free for the next request within one step.
        """
        self.submit()
        assert self.job is not None
        job = self.job
        try:
            async with self._receive:
                async for event in self._receive:
                    yield event
            await job.finished.wait()
            if job.error is not None:
                # A damaged expert becomes one line naming it and the fix (and /health's).
                raise explain(job.error, self.core.container)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop a submitted generation (queued: skipped; running: cancelled and waited for)."""
        job, core = self.job, self.core
        if job is None or self.closed:
            return
        self.closed = True
        try:
            if not job.finished.is_set():
                await core.compute_task.abandon(job)
        finally:
            if not self.started:
                core.waiting -= 1
            core.generations += 1

    async def _body(self, events: trio.MemorySendChannel[Event]) -> None:
        self.started = True
        self.core.waiting -= 1
        if self.admitted is not None:
            self.admitted.set()
        async with events:
            try:
                await self._generate(events)
            finally:
                speculation.release(self.core, self.cache_seen)

    async def _generate(self, events: trio.MemorySendChannel[Event]) -> None:
        core = self.core
        worker = core.worker
        measure = await GenerationMeasure.start(core)
        eos = set(core.tokenizer.eos_token_ids)
        sampler = Sampler(self.params, core.facts.vocab_size, self.tokens)
        stream = TextStream(detokenizer(core.tokenizer), self.params.stop,
                            stop_token_ids=eos | sampler.stop_ids)
        max_tokens = self._max_tokens()
        scored = self.params.prompt_logprobs is not None
        # Benchmark-only calibrated routing routes by (request, position): a state kept
        # from another request was routed as that one, so it is not reused.
        fresh = scored or core.model.routing is not None
        cache, cached = (None, 0) if fresh else await worker.run(core.prefix_cache.take,
                                                                 self.tokens)
        if cache is None:
            cache = core.model.make_cache()
        spec = speculation.row_speculation(core, self.params, self.tokens, max_tokens, cache)
        self.cache_seen = cache
        await measure.reset_peak()
        generated: list[int] = []
        text_parts: list[str] = []
        finish: FinishReason = "length"

        async def emit(text: str, token: int | None) -> None:
            # Log-probabilities of every token sampled since the last delta (a token whose
            # text is held back comes with the next one; see `TextDelta.logprobs`).
            text_parts.append(text)
            tokens = () if token is None else (token,)
            await events.send(TextDelta(text, tokens, sampler.take_logprobs()))

        try:
            if scored:
                logits, entries = await self._prefill_scored(cache)
                await events.send(TextDelta("", (), (), entries))
            else:
                logits = await self._prefill(cache, cached)
            await measure.first_token()
        except BaseException:
            # Cancelled or failed before joining the batch: drop the reads this prefill
            # left in flight and its pins, in a compute turn of its own.
            with trio.CancelScope(shield=True):
                async with core.batch.exclusive():
                    await core.router.drain()
            raise
        batch = core.batch
        row = batch.join(cache, sampler, logits, spec)
        ok = False
        try:
            while len(generated) < max_tokens:
                with timeline.span("compute", "decode-step", index=len(generated)):
                    token = await batch.next(row, more=max_tokens - len(generated) - 1)
                generated.append(token)
                reason = await core.sampling.add(stream, token, emit)
                if reason is not None:
                    finish = reason
                    break
                measure.decode_step()
            await core.sampling.finish(stream, emit)
            left = sampler.take_logprobs()
            if left:  # tokens that never showed text (a stop id, a held-back tail)
                await events.send(TextDelta("", (), left))
            # Leaving the batch undoes a step queued on the last token: the caches
            # come back holding prompt + generated[:-1], as the prefix cache expects.
            cache = await batch.leave(row, want_cache=True)
            ok = True
        finally:
            if not ok:
                await batch.leave(row, want_cache=False)
        measure.stop_clock()
        # The state after prompt + all generated tokens but the last (never fed back).
        if cache is not None:  # on the MLX thread, as every prefix cache operation
            await worker.run(core.prefix_cache.put, self.tokens + generated[:-1], cache)
        stats = await measure.done(len(self.tokens), cached, len(generated), sampler.seed)
        stats = msgspec.structs.replace(stats, **speculation.stats_fields(spec))
        log.info(
            "generation.done",
            finish=finish,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=cached,
            completion_tokens=stats.completion_tokens,
            decode_tok_s=round(stats.decode_tok_s, 2),
            hit_rate=round(stats.hit_rate, 3),
        )
        # A busy server's growth (`heap_trim`); the engine going idle, however this
        # generation ends, is the compute task's `on_idle` (engine_open).
        await worker.run(core.heap_trimmer.maybe_trim)
        await events.send(Done(finish, "".join(text_parts), tuple(generated), stats))
