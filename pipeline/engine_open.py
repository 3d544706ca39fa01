"""Opening an engine: the container, the dense core, the pool, and the actors wired.

`open_core` yields the `EngineCore` that `open_engine` wraps. Who owns what: the reader's
workers, the router, the prefetcher, the compute task, the decode batch and the sampling
task run in the engine's nursery for its whole life; the process's MLX thread
(`MlxWorker.shared()`) runs every MLX operation. A distributed rank passes its `Stage`:
the engine then loads that rank's dense weights, sizes the pool for its layers, and
hands the stage the core once the actors run (`Stage.attach`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import trio

from actors.compute import Compute
from actors.compute_task import ComputeTask
from actors.cuda_direct import pin
from actors.cuda_prefetch import usable as prefetch_usable
from actors.decode_batch import DecodeBatch
from actors.mlx_worker import MlxWorker
from actors.pool.eviction import make_policy
from actors.pool.head_pool import HeadPool
from actors.pool.layout import PoolLayout, widen_for
from actors.pool.slots import SlotTable
from actors.pool.storage import PoolStorage
from actors.prefetch import PrefetchScorer, make_strategy
from actors.reader import ExpertReader
from actors.router import ExpertRouter
from actors.routing_trace import TraceModel, TracePool, TraceRecorder
from actors.run_ahead import RunAheadPolicy
from actors.sampling_task import SamplingTask
from pipeline.config.schema import PipelineConfig
from pipeline.engine_core import EngineCore, ModelFacts
from pipeline.engine_parts import (
    cached_tokenizer,
    device_copy_name,
    device_wait_for,
    direct_probe,
    guarded,
    installer,
    landing_wanted,
    reader_bulk_lane,
    reader_concurrency,
    staging_probe,
)
from pipeline.engine_sizing import (
    PoolTooSmall,
    bank_limit,
    carve_head_pool,
    decode_ahead,
    head_slots,
    num_slots,
    pass_cap,
    pool_banks,
    prefill_chunk_for,
    run_ahead_mode,
    smallest_workable_slots,
)
from pipeline.heap_trim import HeapTrimmer
from pipeline.memory_budget import (
    attach_memory,
    batch_budget,
    check_pool_fits,
    check_state_fits,
    engine_plan,
    staging_buffers,
)
from pipeline.memory_facts import OpenMarks, runtime_up
from pipeline.memory_malloc import map_large_blocks
from pipeline.models.dense import held_bytes, load_dense
from pipeline.models.file_embedding import wants_file
from pipeline.models.kv_quant import kv_quant_for, probe_kernels
from pipeline.models.mtp import head_bytes
from pipeline.models.mtp_experts import StreamedExperts
from pipeline.models.streamed import StreamedModel, activation_dtype
from pipeline.prefix_disk import prefix_cache_for
from pipeline.speculation import HiddenSinks, mtp_wanted, open_mtp, policy_for
from qpack.mtp import MTP_FILE
from qpack.reader import Container, ExpertIO

if TYPE_CHECKING:
    from pipeline.distributed.stage import Stage

log = structlog.get_logger("moestream.engine")


@asynccontextmanager
async def open_core(
    config: PipelineConfig, *, stage: Stage | None = None, record_routing: bool = False,
    io: ExpertIO | None = None,
) -> AsyncIterator[EngineCore]:
    started = time.perf_counter()
    map_large_blocks()  # before anything large is allocated (pipeline/memory_malloc.py)
    marks = OpenMarks()  # RSS before any part: what `memory_breakdown` calls the process
    container = Container.open(Path(config.model.path), verify=config.model.verify, io=io,
                               o_direct=config.reader.o_direct)
    manifest = container.manifest
    # One format, or one per layer (mixed precision); scales as wide as the activations.
    layout = PoolLayout.of(manifest.layers, widen_for(activation_dtype(config.compute.dtype)))
    fmt = layout.formats[next(iter(layout.formats))]
    storage_probe = layout.slot_nbytes
    layers = stage.expert_layers(container) if stage else len(manifest.layers)
    # An untied token embedding may stay on file (memory.embedding): not in the dense core
    # held; an untied lm_head's scales widened to the activations' dtype (pipeline/models/dense.py).
    worker = MlxWorker.shared()
    dtype = await worker.run(activation_dtype, config.compute.dtype)
    on_cpu = await worker.run(runtime_up)
    marks.after_runtime()
    on_file = stage is None and wants_file(config.memory.embedding, on_cpu)
    dense_bytes = stage.dense_bytes if stage else held_bytes(
        container.dense_path, manifest.dense_bytes, embedding_on_file=on_file, head_dtype=dtype)
    # The MTP head, when it drafts: its dense part held like the dense core, its routed
    # experts (when the container streams them) in a pool of their own (actors/pool/head_pool.py).
    mtp_entry, mtp_layout = None, None
    if stage is None and mtp_wanted(config, container):
        dense_bytes += head_bytes(container.root)
        mtp_entry = manifest.mtp_experts
        if mtp_entry is not None:
            mtp_layout = PoolLayout.uniform(mtp_entry.format, layout.widen)
    stride = max(manifest.max_stride, mtp_entry.stride if mtp_entry else 0)
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
    try:
        # First: its load's transient is freed before the dense core arrives (docs/memory.md).
        # A later pipeline rank never sees text: no tokenizer (seconds for a 150k vocabulary).
        tokenizer = None if stage and not stage.plan.first else await trio.to_thread.run_sync(
            guarded, container.root / "tokenizer.json", lambda: cached_tokenizer(container.tokenizer_dir())
        )
        marks.after_tokenizer()
        readers = await trio.to_thread.run_sync(reader_concurrency, config, container)
        # One total budget (memory.budget_mb): the pool is what the measured parts leave.
        plan = engine_plan(config, dense_bytes=dense_bytes, slot_nbytes=storage_probe,
                           stride=stride, readers=readers, need_slots=need,
                           max_slots=manifest.num_experts * layers)
        slots = plan.slots if plan else slots
        mtp_slots = 0
        if mtp_layout is not None:
            mtp_slots = head_slots(config.pool.mtp_slots, slots, len(manifest.layers),
                                   manifest.num_experts, manifest.top_k)
            if config.pool.slots is None:  # sized from bytes: the head's pool comes out of them
                slots = carve_head_pool(slots, need, storage_probe, mtp_slots * mtp_layout.slot_nbytes,
                                        budget_mb=plan.budget_mb if plan else None)
        # Loaded before the actors' nursery opens, so a bad container surfaces as one
        # QpackError naming the file rather than inside an exception group.
        dense = await worker.run(
            guarded, container.dense_path, partial(stage.load_dense, head_dtype=dtype) if stage else partial(
                load_dense, embedding_on_file=on_file, head_dtype=dtype),
            container.config, container.dense_path,
        )
        storage = await worker.run(PoolStorage, layout, slots)
        own = [i for i in container.moe_layers if stage is None or i in stage.plan.layers]
        storage.banks = pool_banks(config, layout, slots, own, need)
        mtp_storage = await worker.run(PoolStorage, mtp_layout, mtp_slots) if mtp_layout else None
        stage_in_threads = await staging_probe(config.reader.stage_in_threads, worker)
        if await direct_probe(config.reader.device_copy, worker, storage, mtp_storage):
            stage_in_threads = False  # installs copy from the staging buffers themselves
        elif stage_in_threads and config.reader.device_copy == "prefetch":
            storage.prefetch_copy = await MlxWorker.staging(0).run(prefetch_usable)
        model = (stage.model if stage else StreamedModel)(
            dense, fmt, storage.arrays, dtype, views=storage.view)
        model.kv_quant = kv_quant_for(config.compute.kv_bits, config.compute.kv_group_size,
                                      model.family, model.parts, manifest.model_type)
        if model.kv_quant is not None and not on_cpu:  # MLX's CPU has every kernel
            await worker.run(probe_kernels, model.kv_quant, model.parts, model.compute_dtype())
        check_state_fits(plan, model.state_bytes)
        async with trio.open_nursery() as nursery:
            core = _start_actors(
                config, container, worker, nursery, model, storage, tokenizer, slots,
                record_routing, started, stage_in_threads, readers, dense_bytes, stride,
                gpu=not on_cpu,
            )
            if stage is None:  # a pipeline rank's forward crosses the boundary per layer
                core.compute.device_wait = await device_wait_for(config, core.compute, storage, worker)
                core.mtp = await worker.run(guarded, container.root / MTP_FILE, open_mtp, config,
                                            container, model, _head_experts(core, mtp_storage))
                if isinstance(model.hidden_sink, HiddenSinks):  # batched steps feed the drafters
                    core.batch.regrouped = model.hidden_sink.regrouped
            attach_memory(core, nursery, plan, marks, need)  # docs/memory.md
            if stage:
                await stage.attach(core)
            yield core
            nursery.cancel_scope.cancel()
    finally:
        container.close()


def _head_experts(core: EngineCore, storage: PoolStorage | None) -> StreamedExperts | None:
    """The MTP head's experts' pool, read through the engine's reader (None: no streamed head)."""
    entry = core.container.manifest.mtp_experts
    if storage is None or entry is None:
        return None
    table = SlotTable(storage.num_slots, make_policy("lru"))
    pool = HeadPool(entry.index, entry.num_experts, table, core.router.reader,
                    installer(core.worker, storage), core.router.install_now)
    log.info("engine.mtp_experts", slots=storage.num_slots, pool_mb=round(storage.nbytes / 2**20, 1))
    return StreamedExperts(pool, storage, core.model.family)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


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
    dense_bytes: int,
    stride: int,
    gpu: bool,
) -> EngineCore:
    manifest = container.manifest
    overlap = config.compute.overlap
    policy_params = {"decay": config.pool.lfu_decay, "period": config.pool.lfu_period}
    policy = make_policy(config.pool.eviction, **(policy_params if config.pool.eviction == "lfu" else {}))
    table = SlotTable(slots, policy, keys=sum(layer.num_experts for layer in manifest.layers),
                      banks=storage.banks)
    storage.layer_of = lambda slot: (table.key_at(slot) or (None,))[0]  # mixed-format installs
    reader = ExpertReader(
        container,
        concurrency=readers,
        buffers=staging_buffers(readers),
        demand_lane=config.reader.demand_lane if overlap else 0,
        bulk_lane=reader_bulk_lane(config, container, readers),
        prefetch_yields=config.reader.prefetch_yields,
        retries=config.reader.retries,
        retry_backoff_s=config.reader.retry_backoff_ms / 1000,
        stage=storage.stage if stage_in_threads else None,
        register=pin if storage.direct is not None else None,
        lander=storage.land if storage.can_land and landing_wanted(config) else None,
        switch_interval_s=config.reader.switch_interval_ms / 1000 or None,
        stride=stride,
        io=config.reader.io,
        gil_hand_over=config.reader.gil_hand_over,
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
        extra=config.prefetch.extra,
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
                bank_limit=bank_limit(config, storage.layout),
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
        run_ahead=RunAheadPolicy(run_ahead_mode(config.compute.run_ahead, slots, len(
            model.moe_layers), model.top_k) if overlap else "off"),
        decode_ahead=decode_ahead(config.compute.decode_ahead, gpu),
        pass_cap=pass_cap(config.prefetch.pass_max_per_layer, model.top_k),
    )
    nursery.start_soon(compute.prefetcher.run)
    core = _core(config, container, worker, model, storage, router, compute, tokenizer,
                 strategy_name, dense_bytes)
    nursery.start_soon(core.compute_task.run)
    nursery.start_soon(core.batch.run)
    nursery.start_soon(core.sampling.run)
    log.info(
        "engine.open",
        container=str(container.root),
        model_type=manifest.model_type,
        slots=slots,
        pool_mb=round(storage.nbytes / 2**20, 1),
        dense_mb=round(dense_bytes / 2**20, 1),
        strategy=strategy_name,
        eviction=config.pool.eviction,
        readers=reader.concurrency,
        readers_prefill=reader.prefill_readers,
        reader_io=reader.io,
        max_batch=core.max_batch,
        stage_in_threads=stage_in_threads,
        device_copy=device_copy_name(storage),
        landing=reader.lander is not None,
        seconds=round(time.perf_counter() - started, 2),
    )
    return core


def _core(config: PipelineConfig, container: Container, worker: MlxWorker,
          model: StreamedModel, storage: PoolStorage, router: ExpertRouter, compute: Compute,
          tokenizer: Any, strategy: str, dense_bytes: int) -> EngineCore:
    """The core around the started actors: the sizes decided once, from the config."""
    server, manifest = config.server, container.manifest
    # Distributed ranks keep their own states (pipeline/distributed/prefixes.py).
    disk = None if config.distributed.enabled else server.prefix_cache_dir
    prefix_cache = prefix_cache_for(
        disk, container.root, model.make_cache, disk_mb=server.prefix_cache_disk_mb,
        min_tokens=server.prefix_cache_min_tokens, variant=model.state_variant())
    lock = trio.Lock()
    # A batch step pins the union of its rows' experts for a layer at once: at most
    # slots // top_k rows fit for sure, whatever they route to.
    max_batch = max(1, min(config.compute.max_batch, router.table.num_slots // manifest.top_k))
    facts = ModelFacts(
        name=Path(container.root).stem,
        root=Path(container.root),
        model_type=manifest.model_type,
        vocab_size=int(model.parts.args.vocab_size),
        num_layers=model.num_layers,
        moe_layers=tuple(model.moe_layers),
        attention_layers=tuple(i for i, block in enumerate(model.parts.layers)
                               if not model.family.is_linear(block)),
        num_experts=model.num_experts,
        top_k=model.top_k,
        expert_stride=manifest.max_stride,
        dense_bytes=dense_bytes,
        context_limit=server.context_limit or int(
            _text_config(container.config).get("max_position_embeddings", 1 << 20)),
        slots=storage.num_slots,
        pool_bytes=storage.nbytes,
        prefill_chunk=prefill_chunk_for(
            config.compute.prefill_chunk, config.compute.prefill_max_tokens,
            router.table.layer_slots, manifest.num_experts, manifest.top_k),
        readers=router.reader.concurrency,
        readers_prefill=router.reader.prefill_readers,
        reader_io=router.reader.io,
        o_direct=container.o_direct,
        device_copy=device_copy_name(storage),
        strategy=strategy,
    )
    batch = DecodeBatch(compute, model.batch_caches(), lock)
    # Speculation's guard: a pass's experts within what the pool can pin.
    batch.speculation = policy_for(router.table.layer_slots, manifest.top_k,
                                   config.compute.draft_tokens)
    trimmer = HeapTrimmer()

    async def idle() -> None:
        # However the last generation ended (a cancel too): what is free now is all the
        # traffic left, and a server's holes go back (`heap_trim`).
        await worker.run(trimmer.maybe_trim, True)

    return EngineCore(
        config=config, container=container, worker=worker, model=model, storage=storage,
        router=router, compute=compute, tokenizer=tokenizer, prefix_cache=prefix_cache,
        heap_trimmer=trimmer, lock=lock, batch=batch,
        compute_task=ComputeTask(
            max_batch, batch_budget(config.compute.batch_memory_mb, dense_bytes), idle),
        sampling=SamplingTask(), max_batch=max_batch, facts=facts,
    )
