"""Progress for the long silent steps: loading a model, verifying a container.

On a terminal a live bar or spinner on stderr; elsewhere (CI logs, pipes) one line when
the step starts and one when it ends, so a log still shows what took the time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

from pipeline.cli.term import err

if TYPE_CHECKING:
    from pipeline.config.schema import PipelineConfig
    from pipeline.engine import Engine


def byte_progress(label: str) -> Callable[[int, int], None]:
    """A `progress(done, total)` callback drawing a byte bar on stderr until done == total."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(f"[bold]{label}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=err, transient=True)
    task: list[Any] = []

    def update(done: int, total: int) -> None:
        if not task:
            bar.start()
            task.append(bar.add_task(label, total=total))
        bar.update(task[0], completed=done)
        if done >= total:
            bar.stop()

    return update


@asynccontextmanager
async def loaded_engine(cfg: PipelineConfig, **kwargs: Any) -> AsyncIterator[Engine]:
    """`open_engine`, with a spinner (or a line) while the container opens and the dense
    core, tokenizer and pool are set up; the engine closes on exit as usual."""
    from pipeline.engine import open_engine

    started = time.perf_counter()
    async with AsyncExitStack() as stack:
        if err.is_terminal:
            with err.status(f"loading {cfg.model.path} (checking and reading the dense core) ..."):
                engine = await stack.enter_async_context(open_engine(cfg, **kwargs))
        else:
            err.print(f"loading {cfg.model.path} ...")
            engine = await stack.enter_async_context(open_engine(cfg, **kwargs))
        plan = engine.memory_plan
        budget = "" if plan is None else (
            f" within a memory budget of {plan.budget_mb:,.0f} MiB, context up to "
            f"{engine.context_limit:,} tokens"
            + ("; the default: --memory-mb or --pool-mb to change" if cfg.memory.budget_mb is None else ""))
        bits = cfg.compute.kv_bits
        kv = f"; keys and values at {bits} bits" if bits else ""
        err.print(f"[dim]loaded {engine.name} in {time.perf_counter() - started:.1f} s "
                  f"(expert pool {engine.pool_bytes / 2**20:,.1f} MiB{budget}{kv})[/dim]")
        yield engine
