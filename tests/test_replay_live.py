"""Replay of traces recorded from real generations is exact for every statistics strategy.

The live engine learns from each prompt token's routing but predicts, prefetches and
scores only while decoding; a trace that kept one merged set per prefill chunk replayed
history at 0.3648 against a live 0.3529 (issue 18). Here real engines on tiny synthetic
checkpoints generate for two prompts (prefill chunks of several tokens and of one) and
the replay of the same strategy, rerun from the trace, must give the live counters and
prefetch scores exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers_engine import engine_config, generate
from helpers_forward import tiny_pair

from actors.routing_trace import load_trace, save_trace
from pipeline.engine import open_engine
from pipeline.replay import simulate

PROMPTS = ([4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500], [40, 1079, 264, 8, 3])

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # the case: qwen3_5_moe, history, LRU, 24 slots
    "history-lru-24-chunk4": ("qwen3_5_moe", {
        "pool": {"slots": 24, "eviction": "lru"},
        "compute": {"prefill_chunk": 4},
        "prefetch": {"strategy": "history"},
    }),
    "transition-pin-16-chunk1": ("qwen3_next", {
        "pool": {"slots": 16, "eviction": "pin"},
        "compute": {"prefill_chunk": 1},
        "prefetch": {"strategy": "transition"},
    }),
    # a pool cut into banks (actors/pool/banks.py): 2 of 20 slots, 2 layers' 32 experts each
    "transition-reuse-40-banks": ("qwen3_next", {
        "pool": {"slots": 40, "eviction": "reuse", "bank_slots": 20},
        "compute": {"prefill_chunk": 4},
        "prefetch": {"strategy": "transition"},
    }),
    "history+transition-reuse-12-chunk3": ("qwen3_5_moe", {
        "pool": {"slots": 12, "eviction": "reuse"},
        "compute": {"prefill_chunk": 3},
        "prefetch": {"strategy": "combined", "combine": ["history", "transition"]},
    }),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_statistics_strategies_replay_the_live_run_exactly(
    case: str, synth_checkpoint, packed, tmp_path
) -> None:
    family, overrides = CASES[case]
    _src, qpack = tiny_pair(synth_checkpoint, packed, family, None)
    config = engine_config(qpack, **overrides)
    async with open_engine(config, record_routing=True) as engine:
        for prompt in PROMPTS:
            await generate(engine, prompt, 8)
        live = engine._core.router.table.snapshot()
        live_scores = engine._core.compute.scorer.stats()
        trace = load_trace(save_trace(engine.routing_trace(), tmp_path / "t.json.gz"))
    prefill = [s for s in trace.steps if s.phase == "prefill"]
    assert prefill and all(not e.predictions for s in prefill for e in s.layers)
    chunk = config.compute.prefill_chunk
    assert any(len(e.observed()) == chunk for s in prefill for e in s.layers)
    name = config.prefetch.strategy
    if name == "combined":
        name = "+".join(config.prefetch.combine)
    for strategy in (name, "recorded"):
        replay = simulate(trace, trace.pool.policy, trace.pool.policy_params, strategy,
                          trace.pool.num_slots)
        assert replay.pool == live, strategy
        p = replay.prefetch
        assert (p.predicted, p.correct, p.actual) == (
            live_scores.predicted, live_scores.correct, live_scores.actual
        ), strategy
    assert live.prefetch_installs > 0
