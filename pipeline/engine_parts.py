"""What opening an engine loads and wires: the tokenizer, the pool installer, staging."""

from __future__ import annotations

import ctypes
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import trio

from actors.mlx_worker import MlxWorker
from actors.pool.storage import PoolStorage
from qpack.spec import QpackError

if TYPE_CHECKING:
    from actors.compute import Compute
    from actors.device_wait import Copy, Mailboxes
    from pipeline.config.schema import PipelineConfig
    from qpack.reader import Container

log = structlog.get_logger("moestream.engine")


def cached_tokenizer(root: Path) -> Any:
    """The container's tokenizer (`pipeline.tokenizer`), built once per process and file version."""
    from pipeline.tokenizer import load_tokenizer

    return load_tokenizer(root)


def detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for one generation that keeps every space the model
    wrote: a reply continues its prompt, so after "1, 2, 3," the token " 4" stays " 4"."""
    return tokenizer.detokenizer


def installer(worker: MlxWorker, storage: PoolStorage) -> Callable[[list[Any]], Awaitable[None]]:
    """How finished reads enter the pool: a memcpy on the CPU, DMA from the staging
    buffers where the direct path was probed (actors/cuda_direct.py), else an MLX scatter."""
    if storage.host_bytes is not None:

        async def write(items: list[Any]) -> None:
            storage.write(items)

        return write
    if storage.direct is not None:

        async def dma(items: list[Any]) -> None:
            await worker.run(storage.install_direct, items)

        return dma

    async def install(items: list[Any]) -> None:
        await worker.run(storage.install, items)

    return install


def copier(worker: MlxWorker, storage: PoolStorage) -> Callable[[list[Copy]], Awaitable[None]] | None:
    """Copies into the pool made at once while MLX is idle (a token waiting on the GPU
    that gave up: the copies it may not have pulled): memmoves into a host pool, DMAs
    after MLX's stream on the direct path; None where installs go through MLX."""
    if storage.host_bytes is not None:

        async def memmove(copies: list[Copy]) -> None:
            for dst, src, n in copies:
                ctypes.memmove(dst, src, n)

        return memmove
    writer = storage.direct
    if writer is None:
        return None

    async def dma(copies: list[Copy]) -> None:
        await worker.run(writer.write, copies)

    return dma


# "auto" queues a reading token whole only on a disk this fast (the queue-depth probe's best
# GB/s): there a layer's reads are short and the host's per-layer stepping is what a token
# waits for; on a slower disk the reads are, and stepping overlaps them better. H200, session
# 24 (docs/results.md): the page cache (probe 12-29 GB/s) 1.02-1.18x stepping; the cloud
# disk (probe ~2-3 GB/s, cold O_DIRECT) 0.88x.
FAST_DISK_GB_S = 4.0


def disk_gb_s(container: Container) -> float:
    """The best bandwidth the queue-depth probe measured on this container's disk (cached)."""
    from actors.queue_depth import choose_depth

    return max(choose_depth(container).gb_s.values(), default=0.0)


async def device_wait_for(config: PipelineConfig, compute: Compute, storage: PoolStorage,
                          worker: MlxWorker) -> Mailboxes | None:
    """`compute.device_wait`: where decode tokens may be queued whole and wait on the GPU
    for their reads (actors/device_wait.py), the probed mailboxes, with the router's
    installs set to go off the MLX thread meanwhile; None where they step layer by layer.
    "emulate" waits on the MLX thread instead (any backend whose installs need no MLX)."""
    from actors import awaited
    from actors.device_wait import HostWait, probe
    from actors.pool.direct_install import direct_ok

    router, setting = compute.router, config.compute.device_wait
    if setting == "off":
        return None
    copy_now = copier(worker, storage)
    # The first reason found, in a fixed order: a setting that does not apply says why.
    declined = next((why for why, applies in (
        ("serial (compute.overlap = false)", not config.compute.overlap),
        ("no CUDA direct path", setting == "auto" and storage.direct is None),
        ("installs go through MLX here", copy_now is None),
        # Pulled installs copy blobs as they are: not into a pool that widens their scales.
        ("the pool widens the blobs' scales", not direct_ok(storage.layout)),
        ("the strategy predicts on the MLX thread without a ranking", not awaited.usable(compute.strategy)),
    ) if applies), None)
    if declined is None and setting == "auto":  # the probe only where all else allows it
        gb_s = await trio.to_thread.run_sync(disk_gb_s, router.reader.container)
        if gb_s < FAST_DISK_GB_S:
            declined = f"the disk reads {gb_s:.1f} GB/s (< {FAST_DISK_GB_S:g}): stepping overlaps its reads better"
    if declined is not None:
        log.info("engine.device_wait", on=False, mode=setting, declined=declined)
        return None
    if setting == "emulate":
        wait: Mailboxes | None = HostWait(len(compute.layer_rows))
    else:  # the probe pulls a pattern into the pool's last slot (zeroed again after)
        assert storage.direct is not None  # declined above without one
        wait = await worker.run(probe, len(compute.layer_rows), storage.direct, next(iter(storage.arrays)))
    if wait is not None:
        router.pull, router.copy_now = storage.copy_ranges, copy_now
    log.info("engine.device_wait", on=wait is not None, mode=setting)
    return wait


async def direct_probe(setting: str, worker: MlxWorker, *storages: PoolStorage | None) -> bool:
    """Whether installs DMA straight from the staging buffers ("auto" and "direct": where the
    probe passes; each storage given gets its writer). False leaves every storage as it was."""
    from actors.cuda_direct import probe
    from actors.pool.direct_install import direct_ok

    if setting not in ("auto", "direct"):
        return False
    pools = [s for s in storages if s is not None]
    if not pools or not direct_ok(pools[0].layout):
        return False
    writers = [await worker.run(probe, s.arrays) if direct_ok(s.layout) else None for s in pools]
    if writers[0] is None:
        if setting == "direct":
            log.warning("engine.direct_copy_unavailable", fallback="load")
        return False
    for storage, writer in zip(pools, writers, strict=True):
        storage.direct = writer
    return True


def device_copy_name(storage: PoolStorage) -> str:
    """The copy path this engine's installs took, for its open event and the bench."""
    if storage.host_bytes is not None:
        return "host"
    return "direct" if storage.direct is not None else "prefetch" if storage.prefetch_copy else "load"


async def staging_probe(setting: str, worker: MlxWorker) -> bool:
    """Whether readers may stage blobs on their staging threads (a probe decides "auto")."""
    import mlx.core as mx
    import numpy as np

    from actors.device_staging import to_device
    from actors.mx_typed import to_int

    if setting == "off":
        return False
    on_gpu = await worker.run(lambda: mx.default_device() != mx.cpu)
    if setting == "auto" and not on_gpu:
        return False
    try:
        probe = await MlxWorker.staging(0).run(to_device, np.arange(64, dtype=np.uint8))
        ok = await worker.run(lambda: to_int((probe.astype(mx.int32) + 1).sum()) == 2080)
    except Exception as exc:  # noqa: BLE001 - any failure means "not here"
        log.warning("engine.stage_in_threads_unavailable", error=str(exc))
        return False
    return ok


def reader_concurrency(config: PipelineConfig, container: Container) -> int:
    """Disk threads: 1 for the serial baseline, else the configured count, or for "auto"
    the queue depth the disk needs (measured once per process; blocking, so a thread)."""
    if not config.compute.overlap:
        return 1
    setting = config.reader.concurrency
    if setting == "auto":
        from actors.queue_depth import choose_depth

        return choose_depth(container).depth
    return setting


# Disk threads in all while a prompt is read (the bulk lane's top), within the staging
# buffers a reader gets (pipeline/memory_budget.py: at least 16).
MAX_BULK_DEPTH = 8


def reader_bulk_lane(config: PipelineConfig, container: Container, readers: int) -> int:
    """Threads that read only during a prompt's prefill: with `concurrency = "auto"`, up
    to the probed depth of the best bandwidth (the chosen depth is the smallest within
    80 % of it, for decode's latency); none with a fixed count or without overlap."""
    if config.reader.concurrency != "auto" or not config.compute.overlap:
        return 0
    from actors.queue_depth import choose_depth

    return max(0, min(choose_depth(container).best, MAX_BULK_DEPTH) - readers)


def landing_wanted(config: PipelineConfig) -> bool:
    """`reader.land`: "auto" and "on" land wherever the pool can be written from another
    thread (the caller checks that). Session 16 landed on the disk threads and lost 9 % on
    a page-cache-fast disk, so "auto" then stayed off above a probed 2.5 GB/s; since
    session 17 a staging thread lands, and landing won there too (H200, one lease, two
    pairs: 6.27 / 5.72 tok/s on, 5.40 / 4.95 off; docs/results.md, seventh pass)."""
    return config.reader.land != "off"


def guarded(path: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a loader; anything it raises becomes a QpackError naming the file it read."""
    try:
        return fn(*args)
    except QpackError:
        raise
    except Exception as exc:
        raise QpackError(path, f"does not load for this model: {type(exc).__name__}: {exc}") from exc
