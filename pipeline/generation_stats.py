"""What one generation measures: clocks, counters and memory at its start, at its first
token and at its end, made into its `GenerationStats`.

    measure = await GenerationMeasure.start(core)
    ... prefill ...
    await measure.first_token()
    ... each decode step: measure.decode_step() ...
    measure.stop_clock()   # the last token is out
    stats = await measure.done(prompt_tokens, cached, completion_tokens, seed)

The counters are the engine's (`EngineCore.counters`): what changed between start and
end was this generation's, or shared with the rows it decoded beside in one batch.
"""

from __future__ import annotations

import time

import mlx.core as mx

from pipeline.counters import Counters
from pipeline.engine_core import EngineCore
from pipeline.events import GenerationStats
from pipeline.resident_map import current_rss_mb, peak_rss_mb


class GenerationMeasure:
    def __init__(self, core: EngineCore, counters: Counters) -> None:
        self.core = core
        self.before = counters
        self.t0 = time.perf_counter()
        self.t_first = self.t0
        self.at_first: Counters = counters
        self.prefill_device = 0
        self.decode_rss = 0.0
        self.t_end: float | None = None

    @classmethod
    async def start(cls, core: EngineCore) -> GenerationMeasure:
        """Before the prefill (and before the prefix cache is asked: its time counts, as
        does the wait for the engine's last bookkeeping to settle)."""
        t0 = time.perf_counter()
        measure = cls(core, await core.settled_counters())
        measure.t0 = measure.t_first = t0
        return measure

    async def reset_peak(self) -> None:
        """MLX's peak from here (the state restored, the prefill next); the clock runs on."""
        await self.core.worker.run(mx.reset_peak_memory)

    async def first_token(self) -> None:
        """The prefill is done: its clock, its stall and its device peak end here."""
        self.t_first = time.perf_counter()
        self.at_first = self.core.counters()
        self.prefill_device = await self.core.worker.run(mx.get_peak_memory)
        await self.core.worker.run(mx.reset_peak_memory)
        self.decode_rss = current_rss_mb()

    def decode_step(self) -> None:
        self.decode_rss = max(self.decode_rss, current_rss_mb())

    def stop_clock(self) -> None:
        self.t_end = time.perf_counter()

    async def done(self, prompt_tokens: int, cached: int, completion_tokens: int,
                   seed: int) -> GenerationStats:
        t_end = self.t_end if self.t_end is not None else time.perf_counter()
        # Settled: the prefetch task's scores of the last tokens, the reads they ordered
        # (else lost to this generation's counts and, the next start settling, to both).
        now = await self.core.settled_counters()
        spent = now - self.before
        decode_s = t_end - self.t_first
        decoded = max(completion_tokens - 1, 0)
        stall_decode = now.stall_seconds - self.at_first.stall_seconds
        decode_device = await self.core.worker.run(mx.get_peak_memory)
        ttft = self.t_first - self.t0
        return GenerationStats(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            completion_tokens=completion_tokens,
            ttft_s=ttft,
            prefill_tok_s=(prompt_tokens - cached) / max(ttft, 1e-9),
            decode_tok_s=decoded / decode_s if decoded else 0.0,
            hit_rate=spent.hit_rate,
            hits=spent.hits,
            misses=spent.misses,
            reads=spent.reads,
            bytes_read=spent.bytes_read,
            bytes_read_per_token=spent.bytes_read / max(prompt_tokens - cached + completion_tokens, 1),
            stall_s=spent.stall_seconds,
            stall_fraction=stall_decode / decode_s if decoded else 0.0,
            prefetch_precision=spent.precision,
            prefetch_recall=spent.recall,
            prefetch_wasted_bytes=(spent.predicted - spent.correct) * self.core.facts.expert_stride,
            prefetch_used=spent.prefetch_used,
            prefetch_saved_s=spent.prefetch_used * spent.read_seconds / max(spent.reads, 1),
            # The kernel's high-water mark (getrusage) can trail its current count
            # (statm) by a page or so: the peak is never below what was seen decoding.
            peak_rss_mb=max(peak_rss_mb(), self.decode_rss),
            peak_device_mb=max(self.prefill_device, decode_device) / 2**20,
            decode_rss_mb=self.decode_rss,
            decode_device_mb=decode_device / 2**20,
            seed=seed,
        )
