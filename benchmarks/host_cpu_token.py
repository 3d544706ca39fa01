"""Host CPU per decode token, every expert pooled: the engine's MLX thread against mlx-lm's
resident forward on its calling thread, the same container, one process (issue 31).

On the H200 (session 31's `pairs-1`, warm-all) the engine's MLX thread spent 0.81 s of CPU
over a 0.91 s decode: the token is bound by the host thread that builds and launches it,
not by the GPU, so CUDA graphs (which cut the GPU's launch gaps) gained it nothing while the
resident model gained 20-40 %. This says how much host CPU each side spends per token, and
on which thread, on any backend: on MLX's CPU backend the arithmetic runs on MLX's own
stream threads, so a Python thread's CPU time is its graph building and MLX's bookkeeping.

    python benchmarks/host_cpu_token.py CONTAINER [--tokens 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


ASYNC_EVAL_S: dict[str, float] = {}  # thread name -> CPU seconds inside mx.async_eval


def time_async_eval() -> None:
    """Count each thread's CPU time inside `mx.async_eval` (MLX's C++: the graph's
    encoding and, on CUDA, its launches), apart from the Python that built the graph."""
    import mlx.core as mx

    real = mx.async_eval

    def timed(*arrays: object) -> None:
        t = time.thread_time()
        try:
            real(*arrays)
        finally:
            name = threading.current_thread().name
            ASYNC_EVAL_S[name] = ASYNC_EVAL_S.get(name, 0.0) + time.thread_time() - t

    mx.async_eval = timed


def engine_side(path: str, tokens: int, dtype: str, profile: int = 0) -> dict[str, float]:
    import cProfile
    import pstats

    import trio
    from helpers_engine import generate
    from token_graph import warm_all_engine

    from actors.mlx_worker import MlxWorker
    from pipeline.bench.thread_cpu import between, sample

    runs: dict[int, dict[str, float]] = {}  # generated tokens -> wall and CPU seconds

    async def run() -> None:
        async with warm_all_engine(path, dtype) as engine:
            for n in (2, 2 + tokens):
                ASYNC_EVAL_S.clear()
                start, t0 = sample(), time.perf_counter()
                await generate(engine, [300, 301], n)
                wall, spent = time.perf_counter() - t0, between(start, sample())
                runs[n] = {**spent, "wall": wall, **{f"async_eval_{k}": v for k, v in ASYNC_EVAL_S.items()}}
            if profile:  # the MLX thread's own functions (a profiler set on it stays on it)
                prof = cProfile.Profile()
                await trio.to_thread.run_sync(MlxWorker.shared().call, prof.enable)
                await generate(engine, [300, 301], 2 + tokens)
                await trio.to_thread.run_sync(MlxWorker.shared().call, prof.disable)
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(profile)

    trio.run(run)
    return {f"per_token_{k}": (v - runs[2].get(k, 0.0)) / tokens for k, v in runs[2 + tokens].items()}


def resident_side(path: str, tokens: int, dtype: str) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from token_graph import resident_as

    model = resident_as(path, dtype)
    sampler = make_sampler(temp=0.0)

    def run(n: int) -> tuple[float, float, float]:
        ASYNC_EVAL_S.clear()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in generate_step(mx.array([300, 301]), model, max_tokens=n, sampler=sampler):
            pass
        return time.thread_time() - c0, time.perf_counter() - t0, sum(ASYNC_EVAL_S.values())

    run(4)
    (c2, w2, a2), (cn, wn, an) = run(2), run(2 + tokens)
    return {"per_token_calling_thread": (cn - c2) / tokens, "per_token_wall": (wn - w2) / tokens,
            "per_token_async_eval": (an - a2) / tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("container")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help='"model": each side as it loads by default')
    p.add_argument("--profile", type=int, default=0, help="print the MLX thread's top N functions (stderr)")
    args = p.parse_args()
    time_async_eval()
    result = {"engine": engine_side(args.container, args.tokens, args.dtype, args.profile),
              "resident": resident_side(args.container, args.tokens, args.dtype)}
    print(json.dumps({k: {n: round(v, 5) for n, v in d.items()} for k, d in result.items()}))


if __name__ == "__main__":
    main()
