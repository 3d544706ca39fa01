"""The engine: opens a container, wires the actors, and serves generations in order.

    async with open_engine(config) as engine:
        async for event in engine.generate("Hello", SamplingParams(max_tokens=16)):
            ...

Actors and who owns what: the reader's workers run in the engine's nursery for its
whole life; the process's MLX thread (`MlxWorker.shared()`) runs every MLX operation;
a generation's compute loop runs in the caller's task, so cancelling the caller stops
it at the next layer boundary. One generation runs at a time (a FIFO lock): they share
the pool, and the pool's slots are the scarce resource.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
import trio

from actors.compute import Compute
from actors.compute_task import ComputeTask
from actors.decode_batch import DecodeBatch
from actors.mlx_worker import MlxWorker
from actors.pool.eviction import make_policy
from actors.pool.layout import PoolLayout
from actors.pool.slots import SlotTable
from actors.pool.storage import PoolStorage
from actors.prefetch import PrefetchScorer, make_strategy
from actors.reader import ExpertReader
from actors.router import ExpertRouter
from actors.routing_trace import TraceModel, TracePool, TraceRecorder
from actors.run_ahead import RunAheadPolicy
from actors.sampling_params import SamplingParams
from actors.sampling_task import SamplingTask
from pipeline.chat_template import template_kwargs
from pipeline.config.schema import PipelineConfig
from pipeline.distributed.active import active_stage
from pipeline.engine_parts import (
    cached_tokenizer,
    guarded,
    installer,
    reader_concurrency,
    staging_probe,
)
from pipeline.engine_sizing import (
    PoolTooSmall,
    num_slots,
    prefill_chunk_for,
    smallest_workable_slots,
)
from pipeline.events import Event
from pipeline.generation import Generation
from pipeline.generation_config import default_params
from pipeline.heap_trim import HeapTrimmer
from pipeline.memory_budget import batch_budget, check_pool_fits
from pipeline.models.dense import load_dense
from pipeline.models.streamed import StreamedModel, activation_dtype
from pipeline.prefix_cache import PrefixCache
from pipeline.prefix_disk import prefix_cache_for
from pipeline.speculation import EmulatedDrafts, open_mtp, policy_for, speculation_snapshot
from qpack.reader import Container, ExpertIO

log = structlog.get_logger("moestream.engine")


class Engine:
    def __init__(
        self,
        config: PipelineConfig,
        container: Container,
        worker: MlxWorker,
        model: StreamedModel,
        storage: PoolStorage,
        router: ExpertRouter,
        compute: Compute,
        tokenizer: Any,
    ) -> None:
        self.config = config
        self.container = container
        self.worker = worker
        self.model = model
        self.storage = storage
        self.router = router
        self.compute = compute
        self.tokenizer = tokenizer
        server = config.server
        # Distributed ranks keep their own states (pipeline/distributed/prefixes.py).
        disk = None if config.distributed.enabled else server.prefix_cache_dir
        self.prefix_cache: PrefixCache = prefix_cache_for(
            disk, container.root, model.make_cache,
            disk_mb=server.prefix_cache_disk_mb, min_tokens=server.prefix_cache_min_tokens)
        self.heap_trimmer = HeapTrimmer()
        # The compute turn: held for each prefill chunk and batch step (and by direct
        # users of the compute actor); fair, so prefill and decode alternate.
        self.lock = trio.Lock()
        self.batch = DecodeBatch(compute, model.batch_caches(), self.lock)
        self.emulated_drafts: EmulatedDrafts | None = None  # benchmark-only drafts (bench)
        self.mtp = open_mtp(config, container, model)  # the MTP head, when it drafts
        self.batch.speculation = policy_for(router.table.num_slots, container.manifest.top_k,
                                            config.compute.draft_tokens)
        # A batch step pins the union of its rows' experts for a layer at once: at most
        # slots // top_k rows fit for sure, whatever they route to.
        manifest = container.manifest
        self.max_batch = max(1, min(config.compute.max_batch,
                                    router.table.num_slots // manifest.top_k))
        self.compute_task = ComputeTask(
            self.max_batch,
            batch_budget(config.compute.batch_memory_mb, manifest.dense_bytes))
        self.sampling = SamplingTask()
        self.context_limit = config.server.context_limit or int(
            _text_config(container.config).get("max_position_embeddings", 1 << 20)
        )
        self.waiting = 0
        self.generations = 0
        self.prefill_chunk = prefill_chunk_for(
            config.compute.prefill_chunk, config.compute.prefill_max_tokens,
            router.table.num_slots, manifest.num_experts, manifest.top_k,
        )

    @property
    def busy(self) -> bool:
        """A generation is running (prefilling or decoding)."""
        return self.compute_task.busy

    @property
    def name(self) -> str:
        return Path(self.container.root).stem

    @property
    def pool_bytes(self) -> int:
        return self.storage.nbytes

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_tokens(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True,
                                  **template_kwargs(self.config.chat, enable_thinking)}
        if tools:
            kwargs["tools"] = list(tools)
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
        return self.encode(text)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        admitted: trio.Event | None = None,
    ) -> AsyncIterator[Event]:
        """Text deltas as they are decoded, then `Done` with stats.

        `on_prefill(done, total)` is called after each prefill chunk (progress bars);
        `admitted` is set when the generation leaves the queue and starts. Wrap in
        `contextlib.aclosing` when you may stop early, so the pool is handed back at once
        rather than when the generator is collected.
        """
        generation = self.start(prompt, params, on_prefill, admitted)
        async with aclosing(generation.run()) as events:
            async for event in events:
                yield event

    def start(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        admitted: trio.Event | None = None,
    ) -> Generation:
        """Submit a generation now, to run concurrently with others (one decode batch);
        read it with `generation.run()`, or `await generation.close()` if you never do."""
        tokens = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        generation = Generation(self, tokens, params or default_params(self), on_prefill)
        generation.admitted = admitted
        generation.check()
        generation.submit()
        return generation

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        enable_thinking: bool | None = None,
    ) -> AsyncIterator[Event]:
        # Close the inner generator here, in this task: it holds the engine's lock.
        tokens = self.chat_tokens(messages, tools, enable_thinking)
        async with aclosing(self.generate(tokens, params, on_prefill)) as events:
            async for event in events:
                yield event

    async def warm(self) -> int:
        """Read every expert into the pool (it must hold them all); returns how many were read.

        For users with memory to spare (and the `warm-all` benchmark): decode then never
        waits for the disk and runs ahead, one host sync per token.
        """
        manifest = self.container.manifest
        total = manifest.num_experts * len(self.model.moe_layers)
        if self.router.table.num_slots < total:
            raise PoolTooSmall(
                f"warming needs a slot for every expert ({total}); the pool has "
                f"{self.router.table.num_slots}"
            )
        misses = self.router.table.misses
        async with self.batch.exclusive():
            try:
                for layer in self.model.moe_layers:
                    self.compute.tick += 1
                    await self.router.demand(layer, range(manifest.num_experts), self.compute.tick)
            finally:
                with trio.CancelScope(shield=True):
                    await self.router.drain()
        return self.router.table.misses - misses

    def pool_snapshot(self) -> dict[str, Any]:
        counters = self.router.table.snapshot()
        return {
            "slots": counters.num_slots,
            "resident": counters.resident,
            "pinned": counters.pinned,
            "hit_rate": counters.hit_rate,
            "pool_bytes": self.pool_bytes,
            "loads_in_flight": len(self.router.loads),
            "generations": self.generations,
            "batch_size": self.batch.size,
            "batch_steps": self.batch.stats.steps,
            "batch_rows_stepped": self.batch.stats.rows_stepped,
            "expert_reads": self.router.reader.stats.reads,
            "expert_read_bytes": self.router.reader.stats.bytes_read,
            "stall_seconds": self.router.stats.stall_seconds,
            "prefetch_hits_waited": self.router.stats.prefetch_hits_waited,
            "mlx_seconds": self.compute.stats.mlx_seconds,
            "run_ahead_tokens": self.compute.stats.run_ahead_tokens,
            "run_ahead_misses": self.compute.stats.run_ahead_misses,
            **speculation_snapshot(self.batch.speculation.stats),
        }


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


@asynccontextmanager
async def open_engine(
    config: PipelineConfig, *, record_routing: bool = False, io: ExpertIO | None = None
) -> AsyncIterator[Engine]:
    """Open the container in `config.model.path` and start the actors.

    `io` replaces the container's positional-read layer (fault injection in tests).
    """
    started = time.perf_counter()
    stage = active_stage()  # a pipeline-parallel rank: its slice of the layers only
    container = Container.open(Path(config.model.path), verify=config.model.verify, io=io,
                               o_direct=config.reader.o_direct)
    manifest = container.manifest
    layout = PoolLayout.of(manifest.layers)  # one format, or one per layer (mixed precision)
    fmt = layout.formats[next(iter(layout.formats))]
    storage_probe = layout.slot_nbytes
    layers = stage.expert_layers(container) if stage else len(manifest.layers)
    dense_bytes = stage.dense_bytes if stage else manifest.dense_bytes
    slots = min(num_slots(config, storage_probe, dense_bytes, stage.ranks_on_host if stage else 1),
                manifest.num_experts * layers)
    check_pool_fits(slots * storage_probe, dense_bytes, config.pool.slots is not None or config.pool.budget_mb is not None)
    need = smallest_workable_slots(manifest.num_experts, manifest.top_k, config.compute.prefill_chunk)
    if slots < need:
        raise PoolTooSmall(
            f"expert pool of {slots} slots ({slots * storage_probe / 2**20:.1f} MiB) cannot hold "
            f"one layer's routed experts for a prefill chunk of {config.compute.prefill_chunk} "
            f"tokens: the smallest workable pool is {need} slots = "
            f"{need * storage_probe / 2**20:.1f} MiB (or lower compute.prefill_chunk)"
        )
    worker = MlxWorker.shared()
    try:
        # Loaded before the actors' nursery opens, so a bad container surfaces as one
        # QpackError naming the file rather than inside an exception group.
        dense = await worker.run(
            guarded, container.dense_path, stage.load_dense if stage else load_dense,
            container.config, container.dense_path,
        )
        # A later pipeline rank never sees text: no tokenizer (seconds for a 150k vocabulary).
        tokenizer = None if stage and not stage.plan.first else await trio.to_thread.run_sync(
            guarded, container.root / "tokenizer.json", lambda: cached_tokenizer(container.tokenizer_dir())
        )
        storage = await worker.run(PoolStorage, layout, slots)
        stage_in_threads = await staging_probe(config.reader.stage_in_threads, worker)
        readers = await trio.to_thread.run_sync(reader_concurrency, config, container)
        dtype = await worker.run(activation_dtype, config.compute.dtype)
        model = (stage.model if stage else StreamedModel)(
            dense, fmt, storage.arrays, dtype, views=storage.view)
        async with trio.open_nursery() as nursery:
            engine = _start_actors(
                config, container, worker, nursery, model, storage, tokenizer, slots,
                record_routing, started, stage_in_threads, readers,
            )
            if stage:
                await stage.attach(engine)
            yield engine
            nursery.cancel_scope.cancel()
    finally:
        container.close()


def _start_actors(
    config: PipelineConfig,
    container: Container,
    worker: MlxWorker,
    nursery: trio.Nursery,
    model: StreamedModel,
    storage: PoolStorage,
    tokenizer: Any,
    slots: int,
    record_routing: bool,
    started: float,
    stage_in_threads: bool,
    readers: int,
) -> Engine:
    manifest = container.manifest
    overlap = config.compute.overlap
    policy_params = {"decay": config.pool.lfu_decay, "period": config.pool.lfu_period}
    policy = make_policy(config.pool.eviction, **(policy_params if config.pool.eviction == "lfu" else {}))
    table = SlotTable(slots, policy)
    storage.layer_of = lambda slot: (table.key_at(slot) or (None,))[0]  # mixed-format installs
    reader = ExpertReader(
        container,
        concurrency=readers,
        retries=config.reader.retries,
        retry_backoff_s=config.reader.retry_backoff_ms / 1000,
        stage=storage.stage if stage_in_threads else None,
        switch_interval_s=config.reader.switch_interval_ms / 1000 or None,
    )
    nursery.start_soon(reader.run)
    router = ExpertRouter(table, reader, model.num_experts, installer(worker, storage))
    nursery.start_soon(router.run)
    strategy_name = config.prefetch.strategy if overlap else "none"
    strategy = make_strategy(
        strategy_name,
        moe_layers=model.moe_layers,
        num_experts=model.num_experts,
        top_k=model.top_k,
        routers=model.router_logits,
        depth=config.prefetch.depth,
        max_per_layer=config.prefetch.max_per_layer,
        combine=config.prefetch.combine,
    )
    recorder = None
    if record_routing:
        recorder = TraceRecorder(
            TraceModel(
                num_layers=model.num_layers,
                moe_layers=list(model.moe_layers),
                num_experts=model.num_experts,
                top_k=model.top_k,
                stride=manifest.max_stride,
            ),
            TracePool(
                num_slots=slots,
                policy=config.pool.eviction,
                policy_params=policy_params if config.pool.eviction == "lfu" else {},
                strategy=strategy_name,
                strategy_params=strategy.params(),
            ),
        )
    compute = Compute(
        worker, model, router, strategy, PrefetchScorer(manifest.max_stride), recorder,
        moe_layers=model.moe_layers,
        # The serial streamer baseline keeps one sync per layer, as it always had.
        run_ahead=RunAheadPolicy(config.compute.run_ahead if overlap else "off"),
    )
    nursery.start_soon(compute.prefetcher.run)
    engine = Engine(config, container, worker, model, storage, router, compute, tokenizer)
    nursery.start_soon(engine.compute_task.run)
    nursery.start_soon(engine.batch.run)
    nursery.start_soon(engine.sampling.run)
    log.info(
        "engine.open",
        container=str(container.root),
        model_type=manifest.model_type,
        slots=slots,
        pool_mb=round(storage.nbytes / 2**20, 1),
        dense_mb=round(manifest.dense_bytes / 2**20, 1),
        strategy=strategy_name,
        eviction=config.pool.eviction,
        readers=reader.concurrency,
        max_batch=engine.max_batch,
        stage_in_threads=stage_in_threads,
        seconds=round(time.perf_counter() - started, 2),
    )
    return engine
