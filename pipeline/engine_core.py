"""The engine's insides: its actors and what they share, private to the engine.

`Engine` (pipeline/engine.py) is the face: it holds one `EngineCore` and hands callers
model facts, counters and generations. Only the engine's own modules take the core: the
generation it runs (pipeline/generation.py), and the distributed stage, which adjusts it
for one rank (pipeline/distributed/stage.py, worker.py). A face (server, CLI, bench)
never reaches in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors.compute import Compute
from actors.compute_task import ComputeTask
from actors.decode_batch import DecodeBatch
from actors.mlx_worker import MlxWorker
from actors.pool.storage import PoolStorage
from actors.router import ExpertRouter
from actors.sampling_task import SamplingTask
from pipeline.config.schema import PipelineConfig
from pipeline.counters import Counters
from pipeline.heap_trim import HeapTrimmer
from pipeline.memory_facts import MemoryPlan, OpenMarks
from pipeline.models.streamed import StreamedModel
from pipeline.prefix_cache import PrefixCache
from qpack.reader import Container


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What an open engine is: the model's shape and the engine's sizes, read-only."""

    name: str  # the container's directory name, without .qpack
    root: Path
    model_type: str
    vocab_size: int
    num_layers: int  # this rank's model: every layer, in one process
    moe_layers: tuple[int, ...]  # the MoE layers it streams (a rank's own, distributed)
    attention_layers: tuple[int, ...]  # full-attention layers (the others: linear attention)
    num_experts: int
    top_k: int
    expert_stride: int  # bytes of one expert on disk (the largest layer's)
    dense_bytes: int  # the dense core held (less a token embedding left on file)
    context_limit: int  # prompt + completion tokens
    slots: int  # the expert pool's size, in experts
    pool_bytes: int
    prefill_chunk: int  # prompt tokens per compute turn
    readers: int  # reads in flight at once
    readers_prefill: int  # ... while a prompt's chunk is read (the bulk lane's too)
    o_direct: bool
    strategy: str  # the prefetch strategy's name ("none" for the serial streamer)
    device_copy: str = "host"  # how blobs reach the pool: host, direct, load, prefetch
    reader_io: str = "threads"  # how reads reach the disk: threads or uring (reader.io)


@dataclass(eq=False)
class EngineCore:
    config: PipelineConfig
    container: Container
    worker: MlxWorker
    model: StreamedModel
    storage: PoolStorage
    router: ExpertRouter
    compute: Compute
    tokenizer: Any
    prefix_cache: PrefixCache
    heap_trimmer: HeapTrimmer
    # The compute turn: held for each prefill chunk and batch step (and by direct users of
    # the compute actor: a later rank's stage loop); fair, so prefill and decode alternate.
    lock: trio.Lock
    batch: DecodeBatch
    compute_task: ComputeTask
    sampling: SamplingTask
    max_batch: int  # a distributed job agrees on the smallest rank's (Stage.attach)
    facts: ModelFacts
    mtp: Any = None  # the MTP head (pipeline.speculation.LoadedMtp) when it drafts, else None
    emulated_drafts: Any = None  # benchmark-only drafts (pipeline.speculation.EmulatedDrafts)
    waiting: int = 0  # generations submitted, not yet started
    generations: int = 0  # generations ended (finished, failed or cancelled)
    memory_plan: MemoryPlan | None = None  # with memory.budget_mb: where it went
    memory_marks: OpenMarks | None = None  # RSS as it opened (pipeline/memory_breakdown.py)

    def counters(self) -> Counters:
        """Every counter now (the prefetch scores as far as the prefetch task got)."""
        table = self.router.table
        reader = self.router.reader
        r, rs, c = reader.stats, self.router.stats, self.compute.stats
        meter = reader.meter.snapshot()
        scores = self.compute.scorer.stats()
        return Counters(
            t=meter.t, hits=table.hits, misses=table.misses,
            prefetch_used=table.prefetch_used, prefetch_wasted=table.prefetch_wasted,
            reads=r.reads, failures=r.failures, landings=r.landings, bytes_read=r.bytes_read,
            shelved=r.shelved, shelved_dropped=rs.shelved_dropped,
            read_seconds=r.read_seconds, queue_seconds=r.queue_seconds,
            pread_seconds=r.pread_seconds, finish_wait_seconds=r.finish_wait_seconds,
            check_seconds=r.check_seconds, stage_seconds=r.stage_seconds,
            disk_busy_seconds=meter.busy_s, disk_in_flight_seconds=meter.in_flight_s,
            stall_seconds=rs.stall_seconds, stall_late_seconds=rs.stall_late_seconds,
            stall_unpredicted_seconds=rs.stall_unpredicted_seconds,
            prefetch_hits_waited=rs.prefetch_hits_waited,
            predicted=scores.predicted, correct=scores.correct, actual=scores.actual,
            mlx_seconds=c.mlx_seconds, run_ahead_tokens=c.run_ahead_tokens,
            run_ahead_misses=c.run_ahead_misses, ahead_steps=c.ahead_steps, awaited_tokens=c.awaited_tokens,
            awaited_layers=c.awaited_layers, awaited_host_seconds=c.awaited_host_seconds,
            awaited_gap_seconds=c.awaited_gap_seconds,
            awaited_gpu_gap_seconds=c.awaited_gpu_gap_seconds, awaited_tail_seconds=c.awaited_tail_seconds,
            awaited_back_seconds=c.awaited_back_seconds, awaited_poll_seconds=c.awaited_poll_seconds,
            awaited_gpu_look_seconds=c.awaited_gpu_look_seconds,
            awaited_ready_layers=c.awaited_ready_layers,
            batch_steps=self.batch.stats.steps,
            batch_rows_stepped=self.batch.stats.rows_stepped,
        )

    async def settled_counters(self) -> Counters:
        """`counters()` once the prefetch task has scored every token sent to it."""
        await self.compute.prefetcher.caught_up()
        return self.counters()
