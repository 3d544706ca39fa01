"""One generation: prefill, then decode token by token, streaming text.

Its body runs as a job of the engine's compute task; the caller's task only reads the
events (`run`).

Owns the request's sampler, detokenizer, stop matcher and model state. If it is
cancelled or fails mid-way, its model state is discarded (a half-updated recurrent
state is useless) and the reads in flight are drained, so the next generation starts
from a clean pool; the pool's contents stay valid and keep serving as a cache.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
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
from pipeline.engine_parts import detokenizer
from pipeline.events import Done, Event, GenerationStats, TextDelta
from pipeline.resident_map import current_rss_mb, peak_rss_mb

if TYPE_CHECKING:
    from pipeline.engine import Engine

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
        engine: Engine,
        tokens: list[int],
        params: SamplingParams,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_prefill = on_prefill  # (tokens done, tokens to do) after each chunk
        self.admitted: trio.Event | None = None  # set when the job starts (left the queue)
        self.tokens = tokens
        self.params = params
        self.started = False
        self.closed = False
        self.job: Job | None = None
        self.cache_seen: list[Any] | None = None

    def check(self) -> None:
        """Refuse what cannot run before taking the engine's lock."""
        limit = self.engine.context_limit
        if not self.tokens:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(self.tokens) >= limit:
            raise PromptTooLong(
                f"prompt has {len(self.tokens)} tokens; the context limit is {limit} "
                f"(prompt + completion), so at most {limit - 1} prompt tokens fit"
            )
        vocab = self.engine.model.parts.args.vocab_size
        bad = next((t for t in self.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        self.params.check_vocab(vocab)
        speculation.check(self.engine, self.params)

    def state_bytes(self) -> int:
        """The most model state this generation can grow to (batch admission)."""
        return self.engine.model.state_bytes(len(self.tokens) + self._max_tokens())

    def _max_tokens(self) -> int:
        room = self.engine.context_limit - len(self.tokens)
        wanted = self.params.max_tokens if self.params.max_tokens is not None else room
        return max(0, min(wanted, room))

    async def _prefill(self, cache: list[Any], start: int) -> mx.array:
        engine = self.engine
        compute, batch = engine.compute, engine.batch
        # All prompt tokens but the last, then the last one alone; checkpoints of the state
        # (see PrefixCache.wants) let a prompt sent again, extended, or sharing a long
        # start with this one restart from there. One chunk per compute turn: while other
        # sequences decode, chunks are capped so their steps come between (no starving).
        end = len(self.tokens) - 1
        prefixes = engine.prefix_cache
        i = start
        while i < end:
            async with batch.exclusive():
                chunk = engine.prefill_chunk
                if batch.size:
                    chunk = min(chunk, engine.config.compute.batch_prefill_chunk)
                part = self.tokens[i : min(i + chunk, end)]
                with timeline.span("compute", "prefill-chunk", tokens=len(part)):
                    await compute.forward(part, cache, "prefill")
            i += len(part)
            if prefixes.wants(i - len(part), i, end):
                await engine.worker.run(prefixes.checkpoint, self.tokens[:i], cache)
            if self.on_prefill is not None:
                self.on_prefill(i, end + 1)
        async with batch.exclusive():
            with timeline.span("compute", "prefill-chunk", tokens=1):
                return await compute.forward(self.tokens[end:], cache, "prefill")

    async def _prefill_scored(self, cache: list[Any]) -> tuple[mx.array, tuple[TokenLogprob, ...]]:
        """Prefill keeping every position's logits: the log-probability of each prompt
        token after the first (`SamplingParams.prompt_logprobs`). Chunks of at most 256
        tokens bound the [tokens, vocab] logits held at once."""
        compute, worker = self.engine.compute, self.engine.worker
        chunk = min(self.engine.prefill_chunk, 256)
        top = self.params.prompt_logprobs or 0
        entries: list[TokenLogprob] = []
        logits = None
        for i in range(0, len(self.tokens), chunk):
            part = self.tokens[i : i + chunk]
            async with self.engine.batch.exclusive():
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
        engine = self.engine
        self._send, self._receive = trio.open_memory_channel[Event](self._max_tokens() + 8)
        send = self._send
        self.job = Job(body=lambda: self._body(send), cost=self.state_bytes())
        engine.waiting += 1
        engine.compute_task.submit(self.job)

    async def run(self) -> AsyncIterator[Event]:
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
                raise explain(job.error, self.engine.container)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop a submitted generation (queued: skipped; running: cancelled and waited for)."""
        job, engine = self.job, self.engine
        if job is None or self.closed:
            return
        self.closed = True
        try:
            if not job.finished.is_set():
                await engine.compute_task.abandon(job)
        finally:
            if not self.started:
                engine.waiting -= 1
            engine.generations += 1

    async def _body(self, events: trio.MemorySendChannel[Event]) -> None:
        self.started = True
        self.engine.waiting -= 1
        if self.admitted is not None:
            self.admitted.set()
        async with events:
            try:
                await self._generate(events)
            finally:
                speculation.release(self.engine, self.cache_seen)

    async def _generate(self, events: trio.MemorySendChannel[Event]) -> None:
        engine = self.engine
        worker = engine.worker
        router = engine.router
        table0 = router.table.snapshot()
        rstats = engine.router.reader.stats
        reader0 = (rstats.reads, rstats.bytes_read, rstats.read_seconds)
        stall0 = router.stats.stall_seconds
        await engine.compute.prefetcher.caught_up()
        scorer0 = engine.compute.scorer.stats()
        vocab = engine.model.parts.args.vocab_size
        eos = set(engine.tokenizer.eos_token_ids)
        sampler = Sampler(self.params, vocab, self.tokens)
        detok = detokenizer(engine.tokenizer)
        stream = TextStream(detok, self.params.stop, stop_token_ids=eos | sampler.stop_ids)
        max_tokens = self._max_tokens()
        scored = self.params.prompt_logprobs is not None
        # Benchmark-only calibrated routing routes by (request, position): a state kept
        # from another request was routed as that one, so it is not reused.
        fresh = scored or engine.model.routing is not None
        cache, cached = (None, 0) if fresh else await worker.run(engine.prefix_cache.take,
                                                                 self.tokens)
        if cache is None:
            cache = engine.model.make_cache()
        spec = speculation.row_speculation(engine, self.params, self.tokens, max_tokens, cache)
        self.cache_seen = cache  # an MTP drafter follows it until the generation ends
        await worker.run(mx.reset_peak_memory)
        t0 = time.perf_counter()
        generated: list[int] = []
        text_parts: list[str] = []
        finish = "length"

        async def emit(text: str, token: int | None) -> None:
            # Log-probabilities of every token sampled since the last delta (a token whose
            # text is held back comes with the next one; see `TextDelta.logprobs`).
            text_parts.append(text)
            tokens = () if token is None else (token,)
            await events.send(TextDelta(text, tokens, sampler.take_logprobs()))

        ok = False
        try:
            if scored:
                logits, entries = await self._prefill_scored(cache)
                await events.send(TextDelta("", (), (), entries))
            else:
                logits = await self._prefill(cache, cached)
            t_first = time.perf_counter()
            stall_prefill = router.stats.stall_seconds
            prefill_device = await worker.run(mx.get_peak_memory)
            await worker.run(mx.reset_peak_memory)
        except BaseException:
            # Cancelled or failed before joining the batch: drop the reads this prefill
            # left in flight and its pins, in a compute turn of its own.
            with trio.CancelScope(shield=True):
                async with engine.batch.exclusive():
                    await router.drain()
            raise
        decode_rss = current_rss_mb()
        batch = engine.batch
        row = batch.join(cache, sampler, logits, spec)
        try:
            while len(generated) < max_tokens:
                with timeline.span("compute", "decode-step", index=len(generated)):
                    token = await batch.next(row, more=len(generated) + 1 < max_tokens)
                generated.append(token)
                reason = await engine.sampling.add(stream, token, emit)
                if reason is not None:
                    finish = reason
                    break
                decode_rss = max(decode_rss, current_rss_mb())
            await engine.sampling.finish(stream, emit)
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
        t_end = time.perf_counter()
        # The state after prompt + all generated tokens but the last (never fed back).
        if cache is not None:  # on the MLX thread, as every prefix cache operation
            await worker.run(engine.prefix_cache.put, self.tokens + generated[:-1], cache)
        table = router.table.snapshot()
        reads = rstats.reads - reader0[0]
        nbytes = rstats.bytes_read - reader0[1]
        scores = engine.compute.scorer.stats()
        predicted = scores.predicted - scorer0.predicted
        correct = scores.correct - scorer0.correct
        actual = scores.actual - scorer0.actual
        hits, misses = table.hits - table0.hits, table.misses - table0.misses
        decode_s = t_end - t_first
        decoded = max(len(generated) - 1, 0)
        stall_decode = router.stats.stall_seconds - stall_prefill
        decode_device = await worker.run(mx.get_peak_memory)
        stats = GenerationStats(
            prompt_tokens=len(self.tokens),
            cached_tokens=cached,
            completion_tokens=len(generated),
            ttft_s=t_first - t0,
            prefill_tok_s=(len(self.tokens) - cached) / max(t_first - t0, 1e-9),
            decode_tok_s=decoded / decode_s if decoded else 0.0,
            hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            hits=hits,
            misses=misses,
            reads=reads,
            bytes_read=nbytes,
            bytes_read_per_token=nbytes / max(len(self.tokens) - cached + len(generated), 1),
            stall_s=router.stats.stall_seconds - stall0,
            stall_fraction=stall_decode / decode_s if decoded else 0.0,
            prefetch_precision=correct / predicted if predicted else 0.0,
            prefetch_recall=correct / actual if actual else 0.0,
            prefetch_wasted_bytes=(predicted - correct) * engine.container.manifest.max_stride,
            prefetch_used=table.prefetch_used - table0.prefetch_used,
            prefetch_saved_s=(table.prefetch_used - table0.prefetch_used)
            * (rstats.read_seconds - reader0[2]) / max(reads, 1),
            peak_rss_mb=peak_rss_mb(),
            peak_device_mb=max(prefill_device, decode_device) / 2**20,
            decode_rss_mb=decode_rss,
            decode_device_mb=decode_device / 2**20,
            seed=sampler.seed,
            **speculation.stats_fields(spec),
        )
        log.info(
            "generation.done",
            finish=finish,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=cached,
            completion_tokens=stats.completion_tokens,
            decode_tok_s=round(stats.decode_tok_s, 2),
            hit_rate=round(stats.hit_rate, 3),
        )
        # Between generations, not in anyone's latency: see `heap_trim`.
        await worker.run(engine.heap_trimmer.maybe_trim)
        await events.send(Done(finish, "".join(text_parts), tuple(generated), stats))  # type: ignore[arg-type]
