"""Whether the streamed forward and the one with every expert pooled give the same numbers
on this machine's backend, at a container's own dimensions.

    python benchmarks/pool_exact_check.py MODEL [--pool-mb 1024] [--tokens 16] [--prompts 2]
        [--variants pooled,pooled-stepped,streamed-f32,pooled-f32]

Greedy generations of random prompts with the top-5 log-probabilities of every token, in
one engine per setting: the pool at `--pool-mb` (most layers read: the stepped path) and
every expert pooled after `engine.warm()` (the whole token in one evaluation). Reported per
prompt as `batch_logits_check.py` reports a batched row: identical tokens, the first
position they part at, the largest |difference| of the log-probabilities before it, and
the top-two margin there. On MLX's CPU backend the two are bit for bit equal (tests); on a
GPU `bench`'s sampled `warm-all` tokens parted from the streamed run's (docs/results.md,
twelfth pass), and this says whether greedy ones do and by how much. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_logits_check import Run, _one, compare  # noqa: E402

from pipeline.bench.spec import prompt_ids  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402

# Each variant's config beside the streamed one; `pooled`: every expert pooled by warm().
# "pooled-stepped" keeps every expert pooled but turns the run-ahead off (one evaluation
# per MoE layer, as a read-missing token runs), so a difference between "pooled" and
# "streamed" is put down to the evaluation's granularity or to the pool's contents.
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "pooled": (True, {}),
    "pooled-stepped": (True, {"compute": {"run_ahead": "off"}}),
    "streamed-f32": (False, {"compute": {"dtype": "float32"}}),
    "pooled-f32": (True, {"compute": {"dtype": "float32"}}),
}


@asynccontextmanager
async def engine_for(model: Path, pool_mb: int, pooled: bool,
                     extra: dict[str, Any] | None = None) -> AsyncIterator[Any]:
    """An engine on `model`: a `pool_mb` pool, or every expert pooled (`warm()` done);
    `extra`: config sections over that (pool_contents_check.py opens its engines here too)."""
    from pipeline.engine import open_engine

    raw: dict[str, Any] = {"model": {"path": str(model)}, **(extra or {})}
    if not pooled:
        raw["pool"] = {"budget_mb": pool_mb}
    async with open_engine(config_from_dict(raw, source="<pool check>")) as engine:
        if pooled:
            await engine.warm()
        yield engine


async def _runs(args: argparse.Namespace, pooled: bool, extra: dict[str, Any] | None = None) -> list[Run]:
    async with engine_for(args.model, args.pool_mb, pooled, extra) as engine:
        vocab = engine.facts.vocab_size
        prompts = [prompt_ids(args.prompt_tokens, vocab, args.seed + i) for i in range(args.prompts)]
        return [await _one(engine, p, args.tokens) for p in prompts]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    streamed = await _runs(args, pooled=False)
    out: dict[str, Any] = {"model": str(args.model), "pool_mb": args.pool_mb, "tokens": args.tokens}
    runs: dict[str, list[Run]] = {}
    for name in args.variants.split(","):
        pooled, extra = VARIANTS[name]
        runs[name] = await _runs(args, pooled, extra)
        rows = [compare(s, p) for s, p in zip(streamed, runs[name], strict=True)]
        out[name] = {"identical": all(r["identical"] for r in rows), "prompts": rows}
    if {"streamed-f32", "pooled-f32"} <= runs.keys():  # float32 activations, both paths
        rows = [compare(s, p) for s, p in zip(runs["streamed-f32"], runs["pooled-f32"], strict=True)]
        out["f32 streamed vs pooled"] = {"identical": all(r["identical"] for r in rows), "prompts": rows}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="pooled", help=f"against the streamed run: {','.join(VARIANTS)}")
    print(json.dumps(trio.run(main, ap.parse_args())), flush=True)
