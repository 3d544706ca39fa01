"""What `speculative = "auto"` costs a token it does not speculate on: one engine (every
expert pooled, the container's MTP head loaded, `compute.speculative = "auto"`), requests
with `speculative = "off"` and `"auto"` alternating, each side's wall and host CPU per
decode token by thread, and the auto side's trials and passes (issue 24's target: `auto`
never below 0.97x plain; on the H100, session 33, a head that never hits gave 0.73x).

    python benchmarks/auto_plain_cost.py CONTAINER [--tokens 32] [--rounds 3] [--dtype model]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


async def one(engine: Any, mode: str, n: int) -> tuple[dict[str, float], Any]:
    """One greedy generation of `n` tokens with `speculative = mode`: its wall, each
    thread's CPU seconds, and its Done stats."""
    import msgspec
    from helpers_engine import greedy

    from pipeline.bench.thread_cpu import between, sample
    from pipeline.bench.warm_pairs import finished

    params = msgspec.structs.replace(greedy(n), speculative=mode)
    start, t0 = sample(), time.perf_counter()
    done = await finished(engine, [300, 301], params)
    return {**between(start, sample()), "wall": time.perf_counter() - t0}, done.stats


def per_token(long: dict[str, float], short: dict[str, float], tokens: int) -> dict[str, float]:
    return {k: round((v - short.get(k, 0.0)) / tokens * 1e3, 3) for k, v in long.items()}


def main() -> None:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("container")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="model", help='"model": the engine\'s default')
    args = p.parse_args()
    out: dict[str, list[dict[str, float]]] = {"off": [], "auto": []}
    stats: dict[str, Any] = {}

    async def run() -> None:
        from token_graph import warm_all_engine

        async with warm_all_engine(args.container, args.dtype, compute={"speculative": "auto"}) as engine:
            for i in range(args.rounds):  # "off" first, every other round "auto" first
                for mode in ("off", "auto") if i % 2 == 0 else ("auto", "off"):
                    short, _ = await one(engine, mode, 2)
                    long, st = await one(engine, mode, 2 + args.tokens)
                    out[mode].append(per_token(long, short, args.tokens))
                    stats[mode] = {f: getattr(st, f) for f in ("speculative", "verify_passes",
                                                               "drafts_proposed", "decode_tok_s")}
            stats["engine"] = {k: v for k, v in engine.pool_snapshot().items()
                               if k in ("shadow_drafts", "speculative_backoffs", "verify_passes",
                                        "ahead_steps", "run_ahead_tokens")}

    trio.run(run)
    wall = {m: [r["wall"] for r in rs] for m, rs in out.items()}
    ratio = [o / a for o, a in zip(wall["off"], wall["auto"], strict=True)]
    print(json.dumps({"ms_per_token": out, "last_stats": stats,
                      "auto_over_plain_tok_s": [round(r, 3) for r in ratio],
                      "median": round(statistics.median(ratio), 3)}, indent=1))


if __name__ == "__main__":
    main()
