"""Decode ms per token with every expert pooled, a second queued step (`compute.decode_ahead
= "on"`) against one (`"off"`), alternating engines in one process, and whether both drew
the same tokens (issue 31's warm-all token; actors/decode.py).

    python benchmarks/decode_ahead_ab.py CONTAINER [--dtype float32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


async def side(path: str, mode: str, dtype: str, runs: int = 3) -> tuple[list[float], list[int]]:
    """`runs` figures of ms per decode token (a 34-token generation less a 2-token one) and
    the last run's tokens, the embedding resident (on file, no second step is queued)."""
    from helpers_engine import generate
    from token_graph import warm_all_engine

    async with warm_all_engine(path, dtype, compute={"decode_ahead": mode},
                               memory={"embedding": "resident"}) as engine:
        out: list[float] = []
        tokens: list[int] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            await generate(engine, [300, 301], 2)
            t2, t0 = time.perf_counter() - t0, time.perf_counter()
            done = await generate(engine, [300, 301], 34)
            out.append((time.perf_counter() - t0 - t2) / 32 * 1e3)
            tokens = list(done.token_ids)
        return out, tokens


def main() -> None:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("container")
    p.add_argument("--dtype", default="model", help='"model": the engine\'s default')
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    async def run() -> None:
        tokens: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                ms, tokens[mode] = await side(args.container, mode, args.dtype)
                print(mode, [round(x, 2) for x in ms], "ms/token", flush=True)
        print("same tokens", tokens["off"] == tokens["on"])

    trio.run(run)


if __name__ == "__main__":
    main()
