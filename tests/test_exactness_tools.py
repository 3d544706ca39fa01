"""The device checks' tools, run here on a tiny bench container so they keep working with
the engine they look into (they are what found every expert pooled computing a wrong
forward on CUDA: docs/results.md, thirteenth pass). On MLX's CPU backend both must report
an exact engine: the pool's bytes equal the file's after real installs and evictions, and
the streamed forward's greedy log-probabilities equal every expert pooled's, in one array
and in banks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


async def test_every_slot_holds_its_experts_bytes(tiny_bench: Path) -> None:
    import pool_contents_check

    args = argparse.Namespace(model=tiny_bench, pool_mb=1, tokens=8, device_copy="auto")
    report = await pool_contents_check.main(args)
    for engine in ("streamed", "pooled"):
        assert report[engine]["checked"] > 0 and report[engine]["bad"] == 0, report[engine]
    assert report["pooled"]["checked"] == report["pooled"]["slots"]  # every expert


async def test_streamed_and_pooled_give_the_same_greedy_log_probabilities(tiny_bench: Path) -> None:
    import pool_exact_check

    args = argparse.Namespace(model=tiny_bench, pool_mb=1, tokens=6, prompts=2, prompt_tokens=8,
                              seed=0, variants="pooled,pooled-stepped")
    report = await pool_exact_check.main(args)
    for variant in ("pooled", "pooled-stepped"):
        rows = report[variant]["prompts"]
        assert report[variant]["identical"], rows
        assert all(r["max_abs_logprob_delta"] == 0.0 for r in rows), rows
    # Every expert pooled in 4 banks of 16 slots (one layer's 16 experts each).
    streamed = await pool_exact_check._runs(args, pooled=False)
    banked = await pool_exact_check._runs(args, pooled=True, extra={"pool": {"bank_slots": 16}})
    assert banked == streamed
