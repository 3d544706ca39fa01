"""Exactness of decode tokens queued whole with the GPU waiting for their reads
(`compute.device_wait`, actors/device_wait.py) on MLX's CUDA backend: tiny 4-bit models of
both Qwen families, greedy, through the whole engine, with and without the wait, at pool
sizes from the smallest workable (misses on most layers) to every expert, 1 and 3 readers,
prefetch strategies next-gate, lookahead (depth 2) and none, with logprobs (every decode
token through `Compute.forward`) and without (the pipelined decoder where it runs ahead).
Every run of a family must give the same tokens and logprobs, bit for bit, and the runs
with the wait must have used it. One JSON line.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/device_wait_check.py [--dir /tmp/wait]
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


async def run(container: Path, wait: str, slots: int, readers: int, strategy: str,
              logprobs: bool) -> dict[str, Any]:
    depth = 2 if strategy == "lookahead" else 1
    cfg = config_from_dict({
        "model": {"path": str(container)}, "pool": {"slots": slots},
        "reader": {"concurrency": readers},
        "compute": {"prefill_chunk": 4, "dtype": "model", "device_wait": wait},
        "prefetch": {"strategy": strategy, "depth": depth},
    })
    tokens: list[int] = []
    values: list[float] = []
    async with open_engine(cfg) as engine:
        before = engine.counters()
        params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5 if logprobs else None)
        async for event in engine.generate(PROMPT, params):
            if isinstance(event, TextDelta):
                for lp in event.logprobs or ():
                    values.append(lp.logprob)
                    values.extend(p for _, p in lp.top)
            if isinstance(event, Done):
                tokens = list(event.token_ids)
                hit = event.stats.hit_rate
        spent = engine.counters() - before
    return {"wait": wait, "slots": slots, "readers": readers, "strategy": strategy,
            "logprobs": logprobs, "tokens": tokens, "values": values, "hit_rate": round(hit, 3),
            "awaited": spent.awaited_tokens, "run_ahead": spent.run_ahead_tokens}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/wait")
    ap.add_argument("--families", default="qwen3_next,qwen3_5_moe")
    ap.add_argument("--mode", default="auto", help="the wait's setting against off (emulate: any backend)")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for family in args.families.split(","):
        root = Path(args.dir) / family
        src = root / "src"
        if not src.exists():
            synthesize(src, family, "tiny", dtype="bfloat16", bits=4, progress=False)
        container = root / "tiny.qpack"
        if not container.exists():
            pack(src, container, progress=False)
        runs = []
        for logprobs in (True, False):
            for slots, readers, strategy in ((16, 1, "next-gate"), (16, 3, "next-gate"), (32, 3, "lookahead"),
                                             (16, 3, "none"), (4096, 3, "next-gate")):
                for wait in ("off", args.mode):
                    runs.append(await run(container, wait, slots, readers, strategy, logprobs))
        same = all(a["tokens"] == b["tokens"] and a["values"] == b["values"]
                   for a, b in zip(runs[::2], runs[1::2], strict=True))
        ref = [r for r in runs if r["logprobs"]]
        same_all = (all(r["values"] == ref[0]["values"] for r in ref)
                    and all(r["tokens"] == ref[0]["tokens"] for r in runs))
        used = all(r["awaited"] > 0 for r in runs if r["wait"] != "off" and r["slots"] < 4096)
        out[family] = {"pairs_identical": same, "all_identical": same_all, "wait_used": used,
                       "runs": [{k: v for k, v in r.items() if k != "values"} for r in runs]}
        print(json.dumps({family: {k: v for k, v in out[family].items() if k != "runs"}}), flush=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    trio.run(main)
