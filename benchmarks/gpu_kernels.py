"""GPU kernel time per decode token, every expert pooled: the engine against mlx-lm's
resident forward, the same container, one process (issue 31's warm-all gap).

Session 32 counted CUDA graphs (33 a token against 22) and host CPU (~0.4 ms a layer
inside `mx.async_eval` at 10 layers), but not what the GPU itself spends: whether the
engine's token is slower because its kernels take longer (the bank-sliced `gather_qmm`,
the slot-map gathers) or because the GPU sits idle between them (the host is late). This
records every CUDA kernel the process runs (CUPTI, through torch's profiler: it sees MLX's
kernels, graph nodes included) over a 2-token generation and a (2 + N)-token one, and per
decode token prints the kernels' count, their summed time, the time the GPU had at least
one kernel running (busy), the wall time, the kernels that took most, and the CUDA
API calls (graph instantiations against updates of cached graphs: MLX keys its graph
cache by each graph's nodes and the dependencies its buffers make between them).

    python benchmarks/gpu_kernels.py CONTAINER [--tokens 16] [--dtype model] [--top 12]

Needs a CUDA build of torch beside MLX's CUDA backend (the H200 has one; not for CI).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


class Kernels:
    """The kernels one profiled run launched, from the profiler's chrome trace."""

    def __init__(self, events: list[dict[str, Any]], wall: float,
                 api: list[dict[str, Any]] | None = None) -> None:
        self.wall = wall
        # CUDA runtime and driver calls by name (CUPTI records every thread's, MLX's
        # included): whether a side instantiates its graphs anew (cudaGraphInstantiate)
        # where the other updates a cached one (cudaGraphExecUpdate) or launches it.
        self.api_calls: Counter[str] = Counter()
        self.api_us: Counter[str] = Counter()
        for e in api or []:
            self.api_calls[e["name"]] += 1
            self.api_us[e["name"]] += float(e["dur"])
        self.spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
        self.by_name: Counter[str] = Counter()
        self.count: Counter[str] = Counter()
        for e in events:
            self.by_name[e["name"]] += float(e["dur"])
            self.count[e["name"]] += 1

    def busy_us(self) -> float:
        """Time with at least one kernel running (overlapping spans merged)."""
        total, end = 0.0, float("-inf")
        for a, b in self.spans:
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total

    def figures(self) -> dict[str, float]:
        return {"kernels": float(len(self.spans)), "kernel_ms": sum(self.by_name.values()) / 1e3,
                "busy_ms": self.busy_us() / 1e3, "wall_ms": self.wall * 1e3}


@contextmanager
def profiled(into: list[Kernels]) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    api = [e for e in trace.get("traceEvents", [])
           if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    into.append(Kernels(events, wall, api))


def per_token(short: Kernels, long: Kernels, tokens: int, top: int) -> dict[str, Any]:
    a, b = short.figures(), long.figures()
    names = Counter({n: (long.by_name[n] - short.by_name.get(n, 0.0)) / tokens for n in long.by_name})
    return {**{f"per_token_{k}": round((b[k] - a[k]) / tokens, 4) for k in a},
            "top_us": [[n[:90], round(us, 1), round((long.count[n] - short.count.get(n, 0)) / tokens, 2)]
                       for n, us in names.most_common(top)],
            # every kernel's launches per token (by name): what one side runs that the other does not
            "count": {n[:120]: round((long.count[n] - short.count.get(n, 0)) / tokens, 2) for n in long.count
                      if long.count[n] != short.count.get(n, 0)},
            # CUDA API calls per token: name -> [calls, microseconds on the calling thread]
            "api": {n: [round((long.api_calls[n] - short.api_calls.get(n, 0)) / tokens, 2),
                        round((long.api_us[n] - short.api_us.get(n, 0.0)) / tokens, 1)]
                    for n in long.api_calls if long.api_calls[n] != short.api_calls.get(n, 0)}}


def engine_runs(path: str, tokens: int, dtype: str) -> list[Kernels]:
    import trio
    from helpers_engine import generate
    from token_graph import warm_all_engine

    out: list[Kernels] = []

    async def run() -> None:
        async with warm_all_engine(path, dtype) as engine:
            for n in (2, 2 + tokens):
                with profiled(out):
                    await generate(engine, [300, 301], n)

    trio.run(run)
    return out


def resident_runs(path: str, tokens: int, dtype: str) -> list[Kernels]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from token_graph import resident_as

    model = resident_as(path, dtype)
    sampler = make_sampler(temp=0.0)
    out: list[Kernels] = []

    def run(n: int) -> None:
        for _ in generate_step(mx.array([300, 301]), model, max_tokens=n, sampler=sampler):
            pass

    run(4)
    for n in (2, 2 + tokens):
        with profiled(out):
            run(n)
    return out


def side(runs: Callable[[str, int, str], list[Kernels]], args: argparse.Namespace) -> dict[str, Any]:
    short, long = runs(args.container, args.tokens, args.dtype)
    return per_token(short, long, args.tokens, args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("container")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", default="model", help='"model": each side as it loads by default')
    p.add_argument("--top", type=int, default=12, help="the N kernels that took most, per side")
    args = p.parse_args()
    import mlx.core  # noqa: F401  (MLX's CUDA libraries first, then torch's profiler)

    result = {"engine": side(engine_runs, args), "resident": side(resident_runs, args)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
