"""Where a waited decode token's build goes (issue 31, the fast disk): the Python that
makes the whole token's graph on the MLX thread before its first layer can publish
(~10-16 ms of ~100 on the H200, docs/results.md fifteenth pass), profiled with cProfile
around `actors.awaited.launch` while the engine decodes, and timed per token: the build
(`make_step` + `launch_with`) and the whole launch (build + evaluation).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/build_profile.py CONTAINER \
        [--tokens 24] [--pool-mb 1024] [--device-wait auto]

On the CPU use `--device-wait emulate` (the wait runs on the MLX thread there, so the
launch's time is mostly the evaluation's; the build's is still the build's).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from actors import awaited  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402
from pipeline.engine import open_engine  # noqa: E402

PROMPT = [970, 11, 1879, 0, 151, 3000, 77, 1234, 5, 6, 7, 8, 13, 21, 34, 55]  # < 8192: tiny presets too


def profiled(profile: cProfile.Profile, builds: list[float], launches: list[float]) -> Any:
    original = awaited.launch

    def launch(wait: Any, seq: int, make_step: Any, rows: dict[int, int], gate: Any) -> Any:
        def timed_step() -> Any:
            start = time.perf_counter()
            step = make_step()
            real = step.launch_with

            def launch_with(lookup: Any) -> Any:
                out = real(lookup)
                builds.append(time.perf_counter() - start)
                return out

            step.launch_with = launch_with
            return step

        start = time.perf_counter()
        profile.enable()
        try:
            return original(wait, seq, timed_step, rows, gate)
        finally:
            profile.disable()
            launches.append(time.perf_counter() - start)

    return launch


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--device-wait", default="auto")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--dtype", default="auto", help="compute.dtype (model: what emulate needs on the CPU)")
    args = ap.parse_args()
    cfg = config_from_dict({
        "model": {"path": args.container}, "pool": {"budget_mb": args.pool_mb},
        "compute": {"device_wait": args.device_wait, "run_ahead": "off", "dtype": args.dtype},
    })
    profile = cProfile.Profile()
    builds: list[float] = []
    launches: list[float] = []
    awaited.launch = profiled(profile, builds, launches)
    async with open_engine(cfg) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
        async for _ in engine.generate(PROMPT, params):
            pass
        spent = engine.counters()
    if not builds:
        print(f"no waited token (device_wait {args.device_wait!r} declined here?)")
        return
    skip = min(2, len(builds) - 1)  # the first tokens compile kernels
    b, w = builds[skip:], launches[skip:]
    print(f"waited tokens {spent.awaited_tokens}: build {1e3 * sum(b) / len(b):.2f} ms, "
          f"launch {1e3 * sum(w) / len(w):.2f} ms a token (mean of {len(b)}, first {skip} left out)")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    trio.run(main)
