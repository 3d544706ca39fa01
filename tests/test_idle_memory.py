"""What an engine holds between requests: the dense core, the pool and what the prefix
cache keeps, nothing of a finished generation beyond that.

The engine's long-lived tasks (the compute task admitting jobs, the batch stepping rows)
once kept their last job and row in a loop variable while they waited for the next: the
finished generation's whole model state stayed alive after the prefix cache had let it go
(86 MiB at 1024 tokens of the 35B; a state too large for the prefix cache stayed beside
the next request's until its first step)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import trio
from helpers_engine import engine_config, generate

from pipeline import engine_hooks as hooks
from pipeline.engine import open_engine


@pytest.fixture(scope="module")
def qwen35(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_5_moe"), bits=4)


def _alive(*kinds: type) -> list[object]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, kinds)]


def test_nothing_of_a_finished_generation_stays_alive(qwen35: Path) -> None:
    """Once a generation has ended (and the prefix cache has let its states go), no
    generation, batch row or compute job of it is reachable, so neither is its state."""
    from actors.compute_task import Job
    from actors.decode_batch import Row
    from pipeline.generation import Generation

    async def main() -> None:
        config = engine_config(qwen35, pool={"slots": 16}, compute={"prefill_chunk": 32})
        async with open_engine(config) as engine:
            for first in (100, 200):  # the second replaces what the first left, if anything
                await generate(engine, list(range(first, first + 40)), 3)
                await hooks.forget_prefixes(engine)
                assert engine.prefix_cache.bytes == 0 and _alive(Generation, Row, Job) == []

    trio.run(main)
