"""Time to first token of a repeated long prompt: the first time, then after a restart
with the on-disk prefix cache (`server.prefix_cache_dir`).

    python benchmarks/prefix_restart.py CONTAINER --tokens 8192 [--out results.json]

Each run is its own process (a real restart: nothing in memory survives), sending the
same prompt of random token ids with max_tokens 1; the first starts from an empty
directory. Prints and writes one JSON object: each run's TTFT, cached tokens, and the
directory's size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def _once(container: str, where: str, tokens: int, pool_mb: int) -> dict[str, Any]:
    import numpy as np

    from actors.sampling_params import SamplingParams
    from pipeline.config.loading import config_from_dict
    from pipeline.engine import open_engine
    from pipeline.events import Done

    cfg = config_from_dict({
        "model": {"path": container}, "pool": {"budget_mb": pool_mb},
        "server": {"prefix_cache_dir": where, "context_limit": tokens + 16}})
    prompt = np.random.default_rng(0).integers(1000, 100000, tokens).tolist()
    t_open = time.perf_counter()
    async with open_engine(cfg) as engine:
        opened = time.perf_counter() - t_open
        done = None
        async for event in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1)):
            if isinstance(event, Done):
                done = event
        assert done is not None
        t_flush = time.perf_counter()
        engine.prefix_cache.flush(600.0)  # type: ignore[attr-defined]
        flushed = time.perf_counter() - t_flush
    return {"ttft_s": round(done.stats.ttft_s, 3), "cached_tokens": done.stats.cached_tokens,
            "prompt_tokens": done.stats.prompt_tokens, "open_s": round(opened, 2),
            "spill_wait_s": round(flushed, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--pool-mb", type=int, default=256)
    ap.add_argument("--dir", help="the prefix cache directory (default: a fresh temporary one)")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import trio

        print(json.dumps(trio.run(_once, args.container, args.dir, args.tokens, args.pool_mb)))
        return
    where = args.dir or tempfile.mkdtemp(prefix="prefix-restart-")
    runs = []
    for label in ("first", "after_restart"):
        out = subprocess.run([sys.executable, __file__, args.container, "--child", "--dir", where,
                              "--tokens", str(args.tokens), "--pool-mb", str(args.pool_mb)],
                             check=True, capture_output=True, text=True)
        runs.append({"run": label, **json.loads(out.stdout.strip().splitlines()[-1])})
    size = sum(p.stat().st_size for p in Path(where).glob("*.mspc"))
    result = {"container": args.container, "tokens": args.tokens, "runs": runs,
              "disk_mb": round(size / 2**20, 1),
              "speedup": round(runs[0]["ttft_s"] / max(runs[1]["ttft_s"], 1e-9), 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
