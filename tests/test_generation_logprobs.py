"""Log-probabilities through a real generation: one per generated token, in order, none
lost to tokens without text (a stop id, a held-back tail), and the same tokens whether
decode is pipelined (lazy draws) or not (logprobs need each token on the host)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from helpers_engine import engine_config

from actors.sampling_params import SamplingParams
from actors.token_logprob import TokenLogprob
from pipeline.engine import open_engine
from pipeline.events import Done, TextDelta

PROMPT = list(range(40, 57))


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


async def _run(engine: object, params: SamplingParams) -> tuple[list[TokenLogprob], Done]:
    entries: list[TokenLogprob] = []
    done = None
    async for event in engine.generate(PROMPT, params):  # type: ignore[attr-defined]
        if isinstance(event, TextDelta):
            entries += event.logprobs
        else:
            done = event
    assert isinstance(done, Done)
    return entries, done


async def test_every_token_has_its_logprob_even_a_stop_id(container: Path) -> None:
    async with open_engine(engine_config(container, pool={"slots": 16})) as engine:
        greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
        entries, done = await _run(engine, greedy)
        assert [e.token for e in entries] == list(done.token_ids)
        assert len(done.token_ids) == done.stats.completion_tokens == 8
        assert all(e.logprob <= 0 and len(e.top) == 2 for e in entries)
        plain_entries, plain = await _run(engine, msgspec.structs.replace(greedy, logprobs=None))
        assert plain.token_ids == done.token_ids and plain_entries == []
        # End on a stop id (no text of its own): its log-probability still arrives.
        k = next(i for i in range(1, 8) if done.token_ids[i] not in done.token_ids[:i])
        stop_id = done.token_ids[k]
        stopped_entries, stopped = await _run(
            engine, msgspec.structs.replace(greedy, stop_token_ids=(stop_id,)))
        assert stopped.finish_reason == "stop" and stopped.token_ids == done.token_ids[: k + 1]
        assert [e.token for e in stopped_entries] == list(stopped.token_ids)


async def test_seeded_biased_sampling_same_with_and_without_pipelining(container: Path) -> None:
    """logit_bias draws lazily (pipelined decode); logprobs force eager draws: a seeded run
    gives the same tokens both ways."""
    async with open_engine(engine_config(container, pool={"slots": 16})) as engine:
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=10,
                                logit_bias=((PROMPT[0], 5.0),))
        _, lazy = await _run(engine, params)
        entries, eager = await _run(engine, msgspec.structs.replace(params, logprobs=0))
        assert lazy.token_ids == eager.token_ids
        assert [e.token for e in entries] == list(eager.token_ids)
