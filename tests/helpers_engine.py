"""Test helpers for the engine: configs for tiny containers, runs that collect what we compare."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.sampling_params import SamplingParams
from pipeline.config.loading import config_from_dict
from pipeline.config.schema import PipelineConfig
from pipeline.events import Done, Event, TextDelta


def engine_config(qpack: Path, **sections: dict[str, Any]) -> PipelineConfig:
    """Chunks of 2 prompt tokens (smallest workable pool: 8 slots) unless overridden."""
    base: dict[str, dict[str, Any]] = {
        "model": {"path": str(qpack)},
        "pool": {"slots": 8},
        "compute": {"prefill_chunk": 2},
        "prefetch": {"strategy": "next-gate"},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return config_from_dict(base)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def generate(engine: Any, prompt: Sequence[int], max_tokens: int) -> Done:
    events: list[Event] = [e async for e in engine.generate(list(prompt), greedy(max_tokens))]
    done = events[-1]
    assert isinstance(done, Done), f"last event {done!r}"
    assert all(isinstance(e, TextDelta) for e in events[:-1])
    return done


async def forward_logits(
    engine: Any, prompt: Sequence[int], decode: Sequence[int]
) -> list[np.ndarray]:
    """Logits through the engine's compute actor: prompt in the config's chunks, then
    `decode` one token at a time, on a fresh cache. Copied to numpy on the MLX thread."""
    chunk = engine.facts.prefill_chunk
    cache = engine._core.model.make_cache()
    out: list[np.ndarray] = []
    async with engine._core.lock:
        for i in range(0, len(prompt), chunk):
            logits = await engine._core.compute.forward(list(prompt[i : i + chunk]), cache, "prefill")
            out.append(await engine._core.worker.run(np.array, logits))
        for token in decode:
            logits = await engine._core.compute.forward([token], cache, "decode")
            out.append(await engine._core.worker.run(np.array, logits))
    return out


def pool_is_clean(engine: Any) -> None:
    """Nothing pinned, no read in flight, nothing left 'loading', within the slot count."""
    snap = engine.pool_snapshot()
    table = engine._core.router.table
    assert snap["pinned"] == 0, snap
    assert snap["loads_in_flight"] == 0, snap
    loading = [k for k in table.resident() if table.state(k) == "loading"]
    assert loading == [], f"keys left loading: {loading}"
    pool_within_slots(engine)


def pool_within_slots(engine: Any) -> None:
    slots = engine.facts.slots
    for name, arr in engine._core.storage.arrays.items():
        assert arr.shape[0] == slots, f"{name}: leading dim {arr.shape[0]} != {slots} slots"
    assert len(engine._core.router.table) <= slots
    assert engine._core.router.table.num_slots == slots
