"""What an engine holds between requests: the dense core, the pool and what the prefix
cache keeps, nothing of a finished generation beyond that.

The engine's long-lived tasks (the compute task admitting jobs, the batch stepping rows)
once kept their last job and row in a loop variable while they waited for the next: the
finished generation's whole model state stayed alive after the prefix cache had let it go
(86 MiB at 1024 tokens of the 35B; a state too large for the prefix cache stayed beside
the next request's until its first step). Then a cycle: the generation held its job, whose
body was a closure over the generation, so the two waited for Python's cyclic collector.
These tests run with the collector off and never collect: what is still referenced, in a
cycle or not, counts as alive."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import trio
from helpers_engine import engine_config, generate

from pipeline import engine_hooks as hooks
from pipeline.bench.spec import every_expert_slots
from pipeline.engine import open_engine


@pytest.fixture(scope="module")
def qwen35(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_5_moe"), bits=4)


@pytest.fixture(autouse=True)
def no_cyclic_collector():
    """A cycle that holds a state would be freed by chance when the collector runs."""
    gc.collect()  # what earlier tests left
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _alive(*kinds: type) -> list[object]:
    return [o for o in gc.get_objects() if isinstance(o, kinds)]


async def _left_alive(*kinds: type) -> list[object]:
    """What of `kinds` is still alive once the engine's tasks have wound down (a job's
    last steps run after its caller has its result): given 5 s, a leak stays."""
    with trio.move_on_after(5):
        while _alive(*kinds):
            await trio.sleep(0.02)
    return _alive(*kinds)


# Stepping as this CPU decodes by default, and a GPU's decode: tokens queued whole waiting
# on their reads (its host side, emulated); with every expert pooled, run ahead with a
# second step queued. (The counters say each ran.)
DECODES = {"stepping": {}, "waited": {"device_wait": "emulate"}, "ahead": {"decode_ahead": "on"}}


@pytest.mark.parametrize("decode", list(DECODES))
def test_nothing_of_a_finished_generation_stays_alive(qwen35: Path, decode: str) -> None:
    """Once a generation has ended (and the prefix cache has let its states go), no
    generation, batch row or compute job of it is reachable, so neither is its state."""
    from actors.compute_task import Job
    from actors.decode_batch import Row
    from pipeline.generation import Generation

    async def main() -> None:
        slots = every_expert_slots(str(qwen35)) if decode == "ahead" else 16
        config = engine_config(qwen35, pool={"slots": slots}, compute={"prefill_chunk": 32, **DECODES[decode]},
                               memory={"embedding": "resident"})
        async with open_engine(config) as engine:
            if decode == "ahead":
                await engine.warm()  # every expert in: steps queue ahead only then
            for first in (100, 200):  # the second replaces what the first left, if anything
                await generate(engine, list(range(first, first + 40)), 6)
                await hooks.forget_prefixes(engine)
                assert engine.prefix_cache.bytes == 0 and await _left_alive(Generation, Row, Job) == []
            spent = engine.counters()
            ran = {"stepping": spent.awaited_tokens == spent.ahead_steps == 0,
                   "waited": spent.awaited_tokens > 0, "ahead": spent.ahead_steps > 0}
            assert ran[decode], spent

    trio.run(main)


def test_nor_of_batched_speculative_or_cancelled_ones(qwen35: Path) -> None:
    import msgspec
    from helpers_engine import greedy

    from actors.compute_task import Job
    from actors.decode_batch import Row
    from pipeline.generation import Generation

    async def run(engine: object, prompt: list[int], params: object) -> None:
        async for _ in engine.generate(prompt, params):  # type: ignore[attr-defined]
            pass

    async def main() -> None:
        config = engine_config(qwen35, pool={"slots": 16}, compute={"prefill_chunk": 32, "max_batch": 4})
        async with open_engine(config) as engine:
            async with trio.open_nursery() as nursery:  # three rows decoding together
                for i in range(3):
                    nursery.start_soon(run, engine, list(range(100 + 50 * i, 140 + 50 * i)), greedy(6))
            await run(engine, [5, 6, 7, 8] * 10, msgspec.structs.replace(greedy(12), speculative="ngram"))
            with trio.move_on_after(0.05):  # a caller that goes away mid-generation
                await run(engine, list(range(300, 360)), greedy(200))
            await hooks.forget_prefixes(engine)
            assert await _left_alive(Generation, Row, Job) == []

    trio.run(main)
