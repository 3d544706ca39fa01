"""Prefix reuse on a real engine: re-sent prompts, follow-ups, entries that survive use,
and a byte budget; reused states must give the same tokens as a cold run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import engine_config, generate

from pipeline.engine import open_engine
from pipeline.prefix_cache import PrefixCache, nbytes


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


async def test_reuse_of_resent_and_extended_prompts(container: Path) -> None:
    prompt = list(range(100, 123))  # 23 tokens: 11 chunks of 2, then the last alone
    async with open_engine(engine_config(container, pool={"slots": 16})) as engine:
        cold = await generate(engine, prompt, 5)
        assert cold.stats.cached_tokens == 0
        # The same prompt again: all but its last token come from the checkpoint, and the
        # entry is still there afterwards (a third send reuses it too).
        for _ in range(2):
            again = await generate(engine, prompt, 5)
            assert again.stats.cached_tokens == len(prompt) - 1
            assert again.token_ids == cold.token_ids
        # A follow-up that repeats the reply token for token uses the end state; one whose
        # reply was re-tokenised differently (here: dropped) still gets the prompt's state.
        follow = prompt + list(cold.token_ids[:-1]) + [7, 8, 9]
        assert (await generate(engine, follow, 2)).stats.cached_tokens == len(prompt) + 4
        other = prompt + [11, 12, 13]
        reused = await generate(engine, other, 3)
        assert reused.stats.cached_tokens == len(prompt) - 1
        engine.prefix_cache.clear()
        fresh = await generate(engine, other, 3)
        assert fresh.stats.cached_tokens == 0 and fresh.token_ids == reused.token_ids


async def test_checkpoints_inside_a_long_shared_start(container: Path) -> None:
    async with open_engine(engine_config(container, pool={"slots": 16})) as engine:
        engine._core.prefix_cache = PrefixCache(interval=8)
        system = list(range(600, 620))  # a shared start of 20 tokens
        first = await generate(engine, system + [1, 2, 3], 2)
        assert first.stats.cached_tokens == 0
        # Checkpoints at 8 and 16 tokens (chunks of 2 crossing multiples of 8), at 22 (all
        # but the last prompt token) and the end state.
        assert len(engine.prefix_cache) == 4
        other = await generate(engine, system + [4, 5, 6], 2)
        assert other.stats.cached_tokens == 16
        engine.prefix_cache.clear()
        assert (await generate(engine, system + [4, 5, 6], 2)).token_ids == other.token_ids


async def test_byte_budget_drops_least_recently_used(container: Path) -> None:
    async with open_engine(engine_config(container, pool={"slots": 16})) as engine:
        await generate(engine, list(range(200, 210)), 2)
        one = engine.prefix_cache.bytes
        assert one > 0 and len(engine.prefix_cache) == 2  # prompt checkpoint + end state
        # Room for about two entries: older prompts' states go first.
        engine._core.prefix_cache = small = PrefixCache(max_bytes=one)
        for start in (300, 400, 500):
            await generate(engine, list(range(start, start + 10)), 2)
        assert small.bytes <= one and len(small) >= 1
        assert nbytes(small.take(list(range(500, 512)))[0]) > 0
        last = await generate(engine, list(range(500, 510)), 2)
        assert last.stats.cached_tokens == 9
        assert (await generate(engine, list(range(300, 310)), 2)).stats.cached_tokens == 0
