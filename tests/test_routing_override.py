"""Benchmark-only calibrated routing drives the real engine and never changes its results.

`bench --routing calibrated` replaces each MoE layer's top-k ids by the routing model's
trace for (request, position, layer). The engine must then (a) route exactly those ids,
every decode token and prefill chunk, and (b) produce identical tokens whatever the pool
size and prefetch strategy (the pool never changes results); with the emulated gate, a
gate strategy's recorded predictions are the model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
from helpers_engine import engine_config, generate
from helpers_forward import tiny_pair

from actors.routing_model.source import CalibratedSource, family_for
from actors.sampling_params import SamplingParams
from pipeline.bench.routing import calibrate
from pipeline.engine import open_engine
from pipeline.events import Done, TextDelta
from pipeline.models.routing_override import RoutingOverride

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999]
TOKENS = 10


async def _run(qpack: Any, routing: str, request: int = 1, **sections: dict[str, Any]):
    config = engine_config(qpack, **sections)
    async with open_engine(config, record_routing=True) as engine:
        override = calibrate(engine, routing, seed=3)
        if override is not None:
            override.begin_request(request)
        done = await generate(engine, PROMPT, TOKENS)
        return done.token_ids, engine.routing_trace(), override, engine.facts.moe_layers


@pytest.fixture(scope="module")
def qpack(synth_checkpoint, packed):
    return tiny_pair(synth_checkpoint, packed, "qwen3_5_moe", None)[1]


async def test_calibrated_routing_routes_the_model_ids_and_pool_settings_do_not_change_tokens(
    qpack,
) -> None:
    small, trace, override, moe = await _run(
        qpack, "calibrated", pool={"slots": 8, "eviction": "lru"}, prefetch={"strategy": "next-gate"})
    big, _, _, _ = await _run(
        qpack, "calibrated", pool={"slots": 48, "eviction": "reuse"}, prefetch={"strategy": "history"},
        compute={"prefill_chunk": 3})
    gated, gtrace, _, _ = await _run(qpack, "calibrated-gate", pool={"slots": 16},
                                     prefetch={"strategy": "next-gate", "extra": 2})
    assert small == big == gated
    # Every decode step routed the table's ids at its position (prompt, then tokens).
    source = override.source
    decode = [s for s in trace.steps if s.phase == "decode"]
    assert len(decode) == TOKENS - 1
    for i, step in enumerate(decode):
        pos = len(PROMPT) + i
        for entry in step.layers:
            want = source.ids(moe.index(entry.layer), pos, 1)[0]
            assert sorted(entry.chosen) == sorted(want.tolist()), (pos, entry.layer)
    # Prefill: each token's row is the table's row at its position.
    pos = 0
    for step in (s for s in trace.steps if s.phase == "prefill"):
        count = len(step.layers[0].observed())
        for entry in step.layers:
            rows = source.ids(moe.index(entry.layer), pos, count)
            assert [sorted(r) for r in entry.observed()] == [sorted(r) for r in rows.tolist()]
        pos += count
    assert pos == len(PROMPT)
    # The emulated gate's predictions are what the gate strategy recorded: its top-k and,
    # asked for 2 more (`extra`), its next two ranks.
    checked = 0
    top_k = source.model.shape.top_k
    for i, step in enumerate(s for s in gtrace.steps if s.phase == "decode"):
        pos = len(PROMPT) + i
        for entry in step.layers:
            for layer, ids in entry.predictions:
                assert len(ids) == top_k + 2
                want = source.gate(moe.index(layer), pos, 1)[0][: len(ids)]
                assert sorted(ids) == sorted(want.tolist())
                checked += 1
    assert checked >= 3


async def test_the_routers_own_choice_differs_and_requests_route_differently(qpack) -> None:
    _, own, _, _ = await _run(qpack, "router")
    _, first, _, _ = await _run(qpack, "calibrated", request=0)
    _, second, _, _ = await _run(qpack, "calibrated", request=1)

    def decode_ids(trace: Any) -> list[list[int]]:
        return [sorted(e.chosen) for s in trace.steps if s.phase == "decode" for e in s.layers]

    assert decode_ids(own) != decode_ids(second)
    assert decode_ids(first) != decode_ids(second)


async def test_a_decode_batch_routes_each_row_as_its_own_request(qpack) -> None:
    # One prompt, three requests: alone, each request gives its own tokens; decoded
    # together (rows join one token apart, run-ahead on: steps built before the previous
    # one is evaluated), each row must still get its request's tokens.
    config = engine_config(qpack, pool={"slots": 48}, compute={"max_batch": 3, "run_ahead": "on"})
    async with open_engine(config) as engine:
        override = calibrate(engine, "calibrated-gate", seed=3)
        alone = []
        for i in range(3):
            override.begin_request(10 + i)
            alone.append(list((await generate(engine, PROMPT, 2 * TOKENS)).token_ids))
        assert alone[0] != alone[1] != alone[2], "requests must route differently"

        override.begin_request(10)  # each new sequence's caches take the next request
        got: list[list[int]] = [[], [], []]
        started = [trio.Event() for _ in range(3)]

        async def row(i: int) -> None:
            if i:
                await started[i - 1].wait()  # caches made in row order: request 10 + i
            params = SamplingParams(temperature=0.0, max_tokens=2 * TOKENS)
            async for event in engine.generate(list(PROMPT), params):
                if isinstance(event, TextDelta) and event.token_ids:
                    started[i].set()
                elif isinstance(event, Done):
                    got[i] = list(event.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(row, i)
        assert engine.largest_batch == 3, engine._core.batch.stats
        assert engine.counters().run_ahead_tokens > 0  # steps queued on lazy tokens too
        assert got == alone


def test_tables_are_prefix_stable_and_families_match_shapes() -> None:
    src = CalibratedSource(3, 16, 4, seed=1)
    head = src.ids(2, 0, 10).copy()
    src.ids(0, 1000, 1)  # grows the table by regeneration
    assert np.array_equal(src.ids(2, 0, 10), head)
    assert family_for(256, 8) == "qwen3.6-35b" and family_for(512, 10) == "qwen3-next-80b"
    assert family_for(16, 4) == "qwen3.5-397b" and family_for(64, 12) == "qwen3-next-80b"
    with pytest.raises(ValueError, match="unknown routing family"):
        CalibratedSource(3, 16, 4, family="nope")


def test_the_emulated_gate_predicts_every_row_of_steps_routed_in_lockstep() -> None:
    """A verify pass and the token after it (or a prompt's last chunk and its last token)
    route a layer one after the other and reach the gate as one hidden state: the gate's
    rows are both steps', in that order, not only the latest step's."""
    import mlx.core as mx

    src = CalibratedSource(4, 16, 4, seed=2)
    override = RoutingOverride(src, [0, 1, 2, 3], emulate_gate=True)

    def predicted(logits: mx.array) -> list[set[int]]:
        return [set(np.flatnonzero(np.array(row) > 0).tolist()) for row in logits]

    def gate_rows(layer: int, start: int, count: int) -> list[set[int]]:
        return [set(r.tolist()) for r in src.gate(layer, start, count, 0)]

    override.ids(1, ([7], [0]), 1)  # the previous token's step
    override.ids(1, ([12], [0]), 3)  # a pass of 3 positions ...
    override.ids(1, ([15], [0]), 1)  # ... and the token after it, in lockstep
    got = predicted(override.gate_logits(2, mx.zeros((4, 8))))
    assert got == gate_rows(2, 12, 3) + gate_rows(2, 15, 1)
    override.ids(2, ([16], [0]), 1)  # alone again: its own row only
    assert predicted(override.gate_logits(3, mx.zeros((1, 8)))) == gate_rows(3, 16, 1)
