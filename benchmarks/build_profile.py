"""Where a waited decode token's build goes (issue 31, the fast disk): the Python that
makes the whole token's graph on the MLX thread before its first layer can publish
(~9-13 ms of ~100 on the H200, docs/results.md fifteenth and sixteenth passes), timed
per token while the engine decodes: the whole build (`make_step` + `launch_with`), the
part of it in the layers' lookups (each MoE layer's wait kernel call and the gate's
ranking), and the evaluation after it.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/build_profile.py CONTAINER \
        [--tokens 24] [--pool-mb 1024] [--device-wait auto]

Timers, not cProfile: on Python 3.12 cProfile (sys.monitoring) sees every thread, so a
profile of the MLX thread's build also counted the event loop and the disk threads and
slowed them (session 26). On the CPU use `--device-wait emulate --dtype model` (the
wait then evaluates each layer inside the build: the lookups' time is mostly that).
"""

from __future__ import annotations

import argparse
import statistics
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


class Timings:
    def __init__(self) -> None:
        self.build: list[float] = []
        self.lookups: list[float] = []
        self.launch: list[float] = []


def timed(t: Timings) -> Any:
    original = awaited.launch

    def launch(wait: Any, seq: int, make_step: Any, rows: dict[int, int], gate: Any) -> Any:
        spent = [0.0]
        start = time.perf_counter()

        def timed_step() -> Any:
            step = make_step()
            real = step.launch_with

            def launch_with(lookup: Any) -> Any:
                def timed_lookup(*args: Any) -> Any:
                    begun = time.perf_counter()
                    try:
                        return lookup(*args)
                    finally:
                        spent[0] += time.perf_counter() - begun

                out = real(timed_lookup)
                t.build.append(time.perf_counter() - start)
                t.lookups.append(spent[0])
                return out

            step.launch_with = launch_with
            return step

        try:
            return original(wait, seq, timed_step, rows, gate)
        finally:
            t.launch.append(time.perf_counter() - start)

    return launch


def ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.2f} ms (min {1e3 * min(values):.2f}, max {1e3 * max(values):.2f})"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--device-wait", default="auto")
    ap.add_argument("--dtype", default="auto", help="compute.dtype (model: what emulate needs on the CPU)")
    args = ap.parse_args()
    cfg = config_from_dict({
        "model": {"path": args.container}, "pool": {"budget_mb": args.pool_mb},
        "compute": {"device_wait": args.device_wait, "run_ahead": "off", "dtype": args.dtype},
    })
    t = Timings()
    awaited.launch = timed(t)
    async with open_engine(cfg) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
        async for _ in engine.generate(PROMPT, params):
            pass
    if not t.build:
        print(f"no waited token (device_wait {args.device_wait!r} declined here?)")
        return
    skip = min(2, len(t.build) - 1)  # the first tokens compile kernels
    print(f"waited tokens: {len(t.build)} (the first {skip} left out); median a token:")
    print(f"  build       {ms(t.build[skip:])}")
    print(f"  in lookups  {ms(t.lookups[skip:])}")
    print(f"  launch      {ms(t.launch[skip:])} (build + evaluation)")


if __name__ == "__main__":
    trio.run(main)
