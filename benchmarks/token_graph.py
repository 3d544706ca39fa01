"""What one decode token asks MLX to run: the engine's (every expert pooled, the run-ahead's
whole token) against mlx-lm's resident forward, counted by op from MLX's graph export.

    python benchmarks/token_graph.py C.qpack [--dtype bfloat16]

Issue 31 (session 31): on the H200 the resident model gains from MLX's CUDA graphs and the
engine does not (0.66x with graphs, 0.80x without). A token with more nodes launches more
kernels and fills more 100-node graphs; this counts them on any backend (views such as
Reshape or Broadcast cost no kernel; the rest, roughly, one each). CPU-side, no device.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

VIEWS = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided"}


def ops(outputs: list[mx.array]) -> Counter[str]:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return Counter(re.findall(r'label ="([A-Za-z_]+)"', Path(f.name).read_text()))


def engine_token(path: str, dtype: str) -> tuple[Counter[str], int]:
    from helpers_engine import engine_config, generate

    from pipeline.bench.spec import every_expert_slots
    from pipeline.engine import open_engine

    seen: list[tuple[int, Counter[str]]] = []  # (outputs, ops) of each evaluation queued
    real = mx.async_eval

    def grab(*arrays: object) -> None:
        outputs = [a for a in arrays if isinstance(a, mx.array)]
        seen.append((len(outputs), ops(outputs)))  # before it runs: then the graph is gone
        real(*arrays)

    async def run() -> None:
        config = engine_config(path, compute={"dtype": dtype, "run_ahead": "on"},
                               pool={"slots": every_expert_slots(path)})
        async with open_engine(config) as engine:
            await generate(engine, [200, 201, 202], 5)
            seen.clear()
            await generate(engine, [300], 4)

    # MLX's own function, for the process (the engine queues each token through it), put
    # back however the run ends.
    mx.async_eval = grab
    try:
        trio.run(run)
    finally:
        mx.async_eval = real
    outputs, counted = max(seen, key=lambda s: s[0])  # a decode token's: ids, flags, streams
    return counted, outputs


@asynccontextmanager
async def warm_all_engine(path: str, dtype: str, **sections: dict[str, Any]) -> AsyncIterator[Any]:
    """The engine as `bench`'s warm-all case has it: a pool of every expert, read in and
    warmed, and a first generation run (its kernels compiled). `dtype`: "model" for the
    engine's default, else `compute.dtype`; `sections`: more config (a `compute` one
    merged with the dtype)."""
    from helpers_engine import engine_config, generate

    from pipeline.bench.spec import every_expert_slots
    from pipeline.engine import open_engine

    compute = {**({} if dtype == "model" else {"dtype": dtype}), **sections.pop("compute", {})}
    config = engine_config(path, compute=compute, pool={"slots": every_expert_slots(path)}, **sections)
    async with open_engine(config) as engine:
        await engine.warm()
        await generate(engine, [200, 201, 202], 4)
        yield engine


def resident_as(path: str, dtype: str) -> Any:
    """mlx-lm's resident model with its floating parameters cast to `dtype`; "float32" or
    "model" leave it as it loads (`bench`'s reference, pipeline/bench/refs.py)."""
    from pipeline.bench.refs import resident_model

    model, _, _ = resident_model(path)
    if dtype not in ("float32", "model"):
        model.set_dtype(getattr(mx, dtype), lambda d: mx.issubdtype(d, mx.floating))
    return model


def resident_token(path: str, dtype: str) -> Counter[str]:
    from mlx_lm.models.cache import make_prompt_cache

    model = resident_as(path, dtype)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[200, 201, 202]]), cache=cache))
    logits = model(mx.array([[300]]), cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    return ops([token, *[a for c in cache for a in c.state if isinstance(a, mx.array)]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("container")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    engine, outputs = engine_token(args.container, args.dtype)
    resident = resident_token(args.container, args.dtype)
    for name, c in (("engine", engine), ("resident", resident)):
        work = sum(n for op, n in c.items() if op not in VIEWS)
        print(f"{name}: {sum(c.values())} nodes, {work} not views"
              + (f" ({outputs} outputs)" if name == "engine" else ""))
    print("op: engine / resident (not views, where they differ)")
    for op in sorted(set(engine) | set(resident), key=lambda o: -(engine[o] - resident[o])):
        if op not in VIEWS and engine[op] != resident[op]:
            print(f"  {op}: {engine[op]} / {resident[op]}")


if __name__ == "__main__":
    main()
