"""Exactness of the direct install on the GPU: a tiny 4-bit Qwen3-Next, greedy, with
logprobs, through the whole engine, for `reader.device_copy` load and direct, at pool sizes
from the smallest workable (a miss on most layers) to every expert, with 1 and 3 readers.
Every run must give the same tokens and the same logprobs, bit for bit. One JSON line.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/direct_exact_check.py [--dir /tmp/exact]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from actors.sampling_params import SamplingParams  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402
from pipeline.engine import open_engine  # noqa: E402
from pipeline.events import Done, TextDelta  # noqa: E402
from qpack.synth.checkpoint import synthesize  # noqa: E402
from qpack.writer import pack  # noqa: E402

PROMPT = [9707, 11, 1879, 0, 151, 30000, 77, 1234, 5, 6, 7, 8]


async def run(container: Path, copy: str, slots: int, readers: int) -> dict[str, Any]:
    cfg = config_from_dict({
        "model": {"path": str(container)}, "pool": {"slots": slots},
        "reader": {"device_copy": copy, "concurrency": readers},
        "compute": {"prefill_chunk": 4, "dtype": "model"},
        "prefetch": {"strategy": "next-gate"},
    })
    tokens: list[int] = []
    logprobs: list[float] = []
    async with open_engine(cfg) as engine:
        used = engine.facts.device_copy
        params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
        async for event in engine.generate(PROMPT, params):
            if isinstance(event, TextDelta):
                for lp in event.logprobs:
                    logprobs.append(lp.logprob)
                    logprobs.extend(p for _, p in lp.top)
            if isinstance(event, Done):
                tokens = list(event.token_ids)
                misses = event.stats.hit_rate
    return {"copy": used, "slots": slots, "readers": readers, "tokens": tokens,
            "logprobs": logprobs, "hit_rate": misses}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/exact")
    args = ap.parse_args()
    root = Path(args.dir)
    src = root / "src"
    if not src.exists():
        synthesize(src, "qwen3_next", "tiny", dtype="bfloat16", bits=4, progress=False)
    container = root / "tiny.qpack"
    if not container.exists():
        pack(src, container, progress=False)
    runs = []
    for slots in (16, 32, 4096):
        for readers in (1, 3):
            for copy in ("load", "direct"):
                runs.append(await run(container, copy, slots, readers))
    first = runs[0]
    same = all(r["tokens"] == first["tokens"] and r["logprobs"] == first["logprobs"] for r in runs)
    print(json.dumps({"identical": same, "runs": [
        {k: v for k, v in r.items() if k not in ("logprobs",)} for r in runs]}), flush=True)


if __name__ == "__main__":
    trio.run(main)
