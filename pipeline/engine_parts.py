"""What opening an engine loads and wires: the tokenizer, the pool installer, staging."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from actors.mlx_worker import MlxWorker
from actors.pool.storage import PoolStorage
from pipeline.generation_config import eos_token_ids
from qpack.spec import QpackError

if TYPE_CHECKING:
    from pipeline.config.schema import PipelineConfig
    from qpack.reader import Container

log = structlog.get_logger("moestream.engine")


def cached_tokenizer(root: Path) -> Any:
    """mlx-lm's tokenizer for a container, built once per process and file version.

    Building it from tokenizer.json takes seconds (150k+ tokens); engines reopened in one
    process (tests, benchmarks) share it. Sharing is safe: each generation takes its own
    detokenizer copy, and encoding is stateless.
    """
    path = Path(root) / "tokenizer.json"
    stamp = path.stat().st_mtime_ns if path.exists() else 0
    return _load_tokenizer(str(Path(root).resolve()), stamp)


# Eight: a process that opens many containers (a test worker, a benchmark) meets a handful
# of tokenizers; reloading one costs 1-2 s (mlx-lm parses tokenizer.json in Python).
@functools.lru_cache(maxsize=8)
def _load_tokenizer(root: str, stamp: int) -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(root), eos_token_ids=eos_token_ids(Path(root)))


def detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for one generation that keeps every space the model wrote.

    mlx-lm's BPE and SentencePiece detokenizers drop the first token's leading space (they
    are written for replies shown on their own). Here a reply continues its prompt: after
    "1, 2, 3," the token " 4" must stay " 4", or prompt + text is not what the model
    produced (code completion and every client that concatenates break).
    """
    detok = tokenizer.detokenizer  # mlx-lm hands out a reset copy per call
    if hasattr(detok, "trim_space"):
        detok.trim_space = False
    elif hasattr(detok, "_maybe_trim_space"):
        detok.__class__ = _keep_space_bpe()
    return detok


@functools.cache
def _keep_space_bpe() -> type:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    class KeepSpaceBPE(BPEStreamingDetokenizer):
        def _maybe_trim_space(self, current_text: str) -> str:
            return current_text

    return KeepSpaceBPE


def installer(worker: MlxWorker, storage: PoolStorage) -> Callable[[list[Any]], Awaitable[None]]:
    """How finished reads enter the pool: a memcpy on the CPU, an MLX scatter elsewhere."""
    if storage.host_bytes is not None:

        async def write(items: list[Any]) -> None:
            storage.write(items)

        return write

    async def install(items: list[Any]) -> None:
        await worker.run(storage.install, items)

    return install


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


def guarded(path: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a loader; anything it raises becomes a QpackError naming the file it read."""
    try:
        return fn(*args)
    except QpackError:
        raise
    except Exception as exc:
        raise QpackError(path, f"does not load for this model: {type(exc).__name__}: {exc}") from exc
