"""Routing traces and `moestream replay` on synthetic traces with known structure."""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from actors.pool.driver import PoolDriver
from actors.pool.eviction import make_policy
from actors.pool.slots import SlotTable
from actors.routing_trace import (
    RoutingTrace,
    TraceModel,
    TracePool,
    TraceRecorder,
    load_trace,
    save_trace,
)
from pipeline.cli.replay import register
from pipeline.replay import simulate

LAYERS = 6
EXPERTS = 16
TOP_K = 2
STRIDE = 16384


def _model() -> TraceModel:
    return TraceModel(
        num_layers=LAYERS,
        moe_layers=list(range(LAYERS)),
        num_experts=EXPERTS,
        top_k=TOP_K,
        stride=STRIDE,
    )


def _local_routing(rng: random.Random, steps: int) -> list[list[list[int]]]:
    """Per step per layer top-k ids: mostly from a small per-layer hot set that drifts."""
    hot = [rng.sample(range(EXPERTS), 4) for _ in range(LAYERS)]
    out = []
    for _ in range(steps):
        if rng.random() < 0.05:
            layer = rng.randrange(LAYERS)
            hot[layer][rng.randrange(4)] = rng.randrange(EXPERTS)
        step = []
        for layer in range(LAYERS):
            pool = hot[layer] if rng.random() < 0.8 else list(range(EXPERTS))
            ids = list(dict.fromkeys(rng.sample(pool, k=min(len(pool), 3))))
            while len(ids) < TOP_K:
                ids.append(rng.randrange(EXPERTS))
                ids = list(dict.fromkeys(ids))
            step.append(ids[:TOP_K])
        out.append(step)
    return out


def _deterministic_routing(rng: random.Random, steps: int) -> list[list[list[int]]]:
    """Layer 0 is random; every later layer is a fixed function of the previous one."""
    out = []
    for _ in range(steps):
        ids = rng.sample(range(EXPERTS), TOP_K)
        step = [ids]
        for layer in range(1, LAYERS):
            ids = [(5 * e + layer) % EXPERTS for e in ids]
            step.append(ids)
        out.append(step)
    return out


def _trace(routing: list[list[list[int]]], num_slots: int = 8) -> RoutingTrace:
    rec = TraceRecorder(_model(), TracePool(num_slots=num_slots, policy="lru"))
    rec.begin_sequence()
    for i, step in enumerate(routing):
        rec.begin_token("prefill" if i == 0 else "decode")
        for layer, ids in enumerate(step):
            rec.record(layer, ids)
    return rec.trace


def _reference_lru(routing: list[list[list[int]]], slots: int) -> tuple[int, int, int]:
    """Plain LRU over the demand stream: (hits, misses, evictions); a layer's miss never
    evicts another of that layer's chosen experts."""
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = misses = evictions = 0
    for step in routing:
        for layer, ids in enumerate(step):
            chosen = {(layer, e) for e in ids}
            for e in ids:
                key = (layer, e)
                if key in cache:
                    hits += 1
                    cache.move_to_end(key)
                    continue
                misses += 1
                if len(cache) == slots:
                    del cache[next(k for k in cache if k not in chosen)]
                    evictions += 1
                cache[key] = None
    return hits, misses, evictions


@pytest.mark.parametrize("policy", ["lfu", "lru", "slru"])
def test_everything_resident_after_warmup(policy: str) -> None:
    routing = _local_routing(random.Random(1), 200)
    trace = _trace(routing)
    distinct = {(layer, e) for step in routing for layer, ids in enumerate(step) for e in ids}
    r = simulate(trace, policy, {}, "history", num_slots=LAYERS * EXPERTS)
    assert r.pool.misses + r.pool.prefetch_installs >= len(distinct)
    assert r.pool.evictions == 0
    # Every key is read at most once: after its first read it is always a hit.
    assert r.pool.misses + r.pool.prefetch_used <= len(distinct)
    total = sum(len(ids) for step in routing for ids in step)
    assert r.pool.hits + r.pool.misses == total
    none = simulate(trace, policy, {}, "none", num_slots=LAYERS * EXPERTS)
    assert none.pool.misses == len(distinct)


@pytest.mark.parametrize("slots", [3, 5, 9, 20, 40])
def test_lru_without_prefetch_matches_reference(slots: int) -> None:
    routing = _local_routing(random.Random(slots), 300)
    r = simulate(_trace(routing), "lru", {}, "none", num_slots=slots)
    assert (r.pool.hits, r.pool.misses, r.pool.evictions) == _reference_lru(routing, slots)
    assert r.prefetch.predicted == 0 and r.pool.prefetch_installs == 0


def test_transition_beats_no_prefetch_on_deterministic_transitions() -> None:
    trace = _trace(_deterministic_routing(random.Random(3), 400))
    for policy in ("lfu", "lru", "slru"):
        none = simulate(trace, policy, {}, "none", num_slots=24)
        tr = simulate(trace, policy, {}, "transition", num_slots=24)
        assert tr.hit_rate > none.hit_rate + 0.3, (policy, tr.hit_rate, none.hit_rate)
        assert tr.prefetch.precision > 0.9
        # layer 0 is random and cannot be predicted: recall is capped at 5/6
        assert 0.7 < tr.prefetch.recall <= 5 / 6


def _recorded_live_run(
    routing: list[list[list[int]]], num_slots: int, strategy: str = "transition", **params: Any
) -> tuple[RoutingTrace, float]:
    """Drive the pool as the live engine does, recording predictions as it goes."""
    from actors.prefetch import make_strategy

    model = _model()
    live = make_strategy(strategy, moe_layers=model.moe_layers, num_experts=EXPERTS, top_k=TOP_K, **params)
    pool = TracePool(num_slots=num_slots, policy="lfu", strategy=strategy, strategy_params=live.params())
    rec = TraceRecorder(model, pool)
    table = SlotTable(num_slots, make_policy("lfu"))
    driver = PoolDriver(table)
    tick = 0
    for half in (routing[: len(routing) // 2], routing[len(routing) // 2 :]):
        rec.begin_sequence()
        live.reset_sequence()
        for step in half:
            rec.begin_token("decode")
            for layer, ids in enumerate(step):
                driver.demand(layer, ids, tick)
                live.observe(layer, ids)
                preds = live.predict(layer, ids, None)
                rec.record(layer, ids, preds)
                driver.prefetch(preds, tick)
                tick += 1
    return rec.trace, table.snapshot().hit_rate


def test_recorded_trace_round_trips_and_replays_the_live_hit_rate(tmp_path: Path) -> None:
    routing = _deterministic_routing(random.Random(4), 120)
    trace, live_hit_rate = _recorded_live_run(routing, num_slots=20)
    for name in ("t.json", "t.json.gz"):
        loaded = load_trace(save_trace(trace, tmp_path / name))
        assert loaded == trace
    assert (tmp_path / "t.json.gz").stat().st_size < (tmp_path / "t.json").stat().st_size
    assert [s.seq for s in loaded.steps] == [0] * 60 + [1] * 60
    recorded = simulate(loaded, "lfu", {}, "recorded", num_slots=20)
    rerun = simulate(loaded, "lfu", {}, "transition", num_slots=20)
    assert recorded.hit_rate == live_hit_rate
    assert recorded.pool == rerun.pool and recorded.prefetch == rerun.prefetch


def test_the_live_strategy_replayed_by_name_keeps_its_recorded_params() -> None:
    """`replay --strategies history` on a trace of a depth-2 history: the same predictions
    as recorded (the sweep once rebuilt it at depth 1 and the default decay)."""
    from pipeline.replay import sweep

    routing = _deterministic_routing(random.Random(5), 80)
    trace, _ = _recorded_live_run(routing, num_slots=20, strategy="history", depth=2, history_decay=0.8)
    assert trace.pool.strategy == "history" and trace.pool.strategy_params == {"decay": 0.8, "depth": 2}
    recorded, by_name = sweep(trace, ["lfu"], ["recorded", "history"], [20])
    assert by_name.pool == recorded.pool and by_name.prefetch == recorded.prefetch


def test_bad_traces_are_refused_with_the_file_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_trace(bad)
    trace = _trace([[[1, 2]] * LAYERS])
    trace.steps[0].layers[3].chosen = [1, EXPERTS]
    save_trace(trace, bad)
    with pytest.raises(ValueError, match=r"bad.json: step 0 layer 3: chosen"):
        load_trace(bad)
    with pytest.raises(ValueError, match="needs the model's routers"):
        simulate(_trace([[[1, 2]] * LAYERS]), "lru", {}, "next-gate", num_slots=4)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moestream")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_replays_a_saved_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, live_hit_rate = _recorded_live_run(
        _deterministic_routing(random.Random(5), 40), num_slots=16
    )
    path = save_trace(trace, tmp_path / "run.json.gz")
    out = tmp_path / "out.json"
    argv = ["replay", str(path), "--policies", "lru,lfu", "--strategies", "none,recorded"]
    rc = _cli([*argv, "--strategies", "none,recorded,history+transition", "--slots", "8", "16"])
    assert rc == 0
    assert _cli([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hit rate" in text and "recorded" in text and "history+transition" in text
    doc = json.loads(out.read_text())
    assert [(r["policy"], r["strategy"]) for r in doc["results"]] == [
        ("lru", "none"),
        ("lru", "recorded"),
        ("lfu", "none"),
        ("lfu", "recorded"),
    ]
    assert doc["results"][3]["hit_rate"] == pytest.approx(live_hit_rate)
    with pytest.raises(SystemExit):
        _cli(["replay", str(path), "--policies", "mru"])
    assert _cli(["replay", str(path), "--strategies", "lookahead"]) == 2


def test_cli_replays_a_generated_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = "qwen3-next-80b,requests=2,layers=2,prompt_tokens=4,decode_tokens=6"
    saved = tmp_path / "w.json.gz"
    argv = ["replay", "--workload", spec, "--policies", "lru,flru,reuse,pin", "--slots", "64"]
    assert _cli([*argv, "--strategies", "none,next-gate", "--save-trace", str(saved)]) == 0
    assert "workload:qwen3-next-80b" in capsys.readouterr().out
    assert len(load_trace(saved).steps) == 2 * (1 + 6)
    assert _cli(["replay", str(saved), "--workload", spec]) == 2
    assert _cli(["replay", "--workload", "mixtral"]) == 2
