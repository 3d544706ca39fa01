"""Probe: where an engine's host RSS grows, stage by stage (issue 25's host target).

Opens the engine on a container (1 GiB pool, O_DIRECT reads, prefill chunks of 16) and
prints RSS, its kinds and largest mappings: before the open, after it (the dense core on
the device, the pool allocated, the tokenizer loaded), after a first 1-token generation
(MLX's kernels loaded on first use), after 24 more tokens, and after `malloc_trim`. What
grows at the first generation without the engine holding anything new on the host is
the CUDA driver's images of the kernels it loads.

    python benchmarks/open_rss.py CONTAINER
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import trio  # noqa: E402

from pipeline.resident_map import current_rss_mb, peak_rss_mb, resident_by_mapping, resident_kinds  # noqa: E402


def mark(step: str, t0: float) -> None:
    print(f"{step:28s} {time.perf_counter() - t0:6.1f}s rss {current_rss_mb():7.0f} peak "
          f"{peak_rss_mb():7.0f} MiB {resident_kinds()} | {resident_by_mapping(6)}", flush=True)


async def main(path: str) -> None:
    from helpers_engine import engine_config, generate

    from pipeline.engine import open_engine

    t0 = time.perf_counter()
    mark("before the open", t0)
    config = engine_config(Path(path), pool={"budget_mb": 1024, "slots": None},
                           compute={"prefill_chunk": 16}, reader={"o_direct": True})
    async with open_engine(config) as engine:
        mark("opened", t0)
        await generate(engine, [300, 301, 302], 1)
        mark("first token", t0)
        await generate(engine, [400, 401, 402], 24)
        mark("24 tokens", t0)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mark("malloc_trim", t0)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
