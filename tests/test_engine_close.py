"""An engine that closes, or a batch step that fails, under requests in every state: each
request ends with an error that says so (never a hang, never a cut stream taken for a
whole one), and the close itself returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from faultio import FaultIO
from helpers_engine import engine_config, generate, greedy, pool_is_clean
from helpers_forward import tiny_pair

from pipeline.engine import open_engine
from pipeline.events import Done, TextDelta

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]


@pytest.fixture
def container(synth_checkpoint, packed) -> Path:
    return tiny_pair(synth_checkpoint, packed, "qwen3_next", None)[1]


async def _outcome(engine: Any, prompt: list[int], n: int, events: list[Any]) -> str:
    try:
        async for event in engine.generate(prompt, greedy(n)):
            events.append(event)
    except Exception as exc:  # noqa: BLE001 - what the caller sees is the point
        return str(exc)
    return "done" if events and isinstance(events[-1], Done) else "cut without an error"


@pytest.mark.parametrize("after", [0.05, 0.6])
async def test_closing_under_a_prefill_or_a_decode_ends_the_request_with_an_error(container, after):
    """Slow reads keep the request in its prefill (a cancelled prefill drains the router in a
    shielded turn: it once waited for a router task already gone, and the close with it) or,
    later, decoding; a second request waits in the queue (max_batch 1)."""
    io = FaultIO(container)
    io.inject("slow", times=None, delay_s=0.02)
    outcomes: dict[str, str] = {}
    config = engine_config(container, compute={"max_batch": 1})

    async def one(name: str, engine: Any) -> None:
        outcomes[name] = await _outcome(engine, PROMPT * 3, 200, [])

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            async with open_engine(config, io=io) as engine:
                nursery.start_soon(one, "a", engine)
                nursery.start_soon(one, "b", engine)
                await trio.sleep(after)
            with trio.fail_after(10):  # each asker is let go, not left waiting
                while len(outcomes) < 2:
                    await trio.sleep(0.01)
    # (trio starts the two in either order: one runs, the other waits)
    assert sorted(outcomes.values()) == ["the engine closed before this generation ran",
                                         "the engine closed during this generation"], outcomes


async def test_a_regroup_that_fails_ends_every_row_including_the_one_joining(container, monkeypatch):
    """The joining row leaves the batch's lists before the regroup runs: the step's error
    must reach it too (it waited for a token forever). Then the engine serves exactly."""
    import actors.decode_batch as decode_batch

    real, failed = decode_batch.regroup_caches, []

    def failing(caches: Any, cache: Any, n_old: int, keep: Any, joins: Any, copies: Any) -> Any:
        if n_old >= 1 and joins and not failed:
            failed.append(True)
            raise MemoryError("an allocation failed while merging the caches")
        return real(caches, cache, n_old, keep, joins, copies)

    monkeypatch.setattr(decode_batch, "regroup_caches", failing)
    async with open_engine(engine_config(container)) as engine:
        want = (await generate(engine, PROMPT, 24)).token_ids
        outcomes: dict[str, str] = {}
        first: list[Any] = []

        async def late() -> None:
            with trio.fail_after(30):
                while sum(isinstance(e, TextDelta) for e in first) < 3:  # A is decoding
                    await trio.sleep(0.005)
                outcomes["joining"] = await _outcome(engine, [40, 1079, 264, 8, 3], 24, [])

        async def early() -> None:
            outcomes["running"] = await _outcome(engine, PROMPT, 24, first)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(early)
                nursery.start_soon(late)
        assert failed, "the regroup never ran with a joining row"
        assert outcomes["joining"] == "an allocation failed while merging the caches", outcomes
        pool_is_clean(engine)
        assert (await generate(engine, PROMPT, 24)).token_ids == want
