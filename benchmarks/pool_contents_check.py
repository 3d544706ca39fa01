"""Whether every ready pool slot holds its expert's bytes, as the container has them.

    python benchmarks/pool_contents_check.py MODEL [--pool-mb 1024] [--tokens 16] [--device-copy load]

Two engines: one streamed (a `--pool-mb` pool, after a greedy generation: prefill and
decode installs, evictions, landings) and one with every expert pooled (`engine.warm()`).
For each, every ready key's slot row of every pool array is summed on the device (bytes
as integers, per row) and compared with the same sums of the blob read from the
container. Reported: keys checked, keys whose bytes differ, and the lowest and highest
slot of each; one JSON line. Written in session 23 when greedy tokens at the 35B's
dimensions parted between the two engines on the H200 (docs/results.md, thirteenth pass).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pool_exact_check import engine_for  # noqa: E402

from pipeline.bench.spec import prompt_ids  # noqa: E402

CHUNK = 512  # slots summed per device evaluation (bounded temporaries)


def _row_sums(array: mx.array) -> np.ndarray:
    """Per slot, the sum of the row's bytes as unsigned integers."""
    out = []
    for start in range(0, array.shape[0], CHUNK):
        rows = array[start:start + CHUNK]
        flat = rows.reshape(rows.shape[0], -1).view(mx.uint8).astype(mx.int32)
        out.append(np.array(flat.sum(axis=1).astype(mx.int64)))
    return np.concatenate(out)


def check(core: Any) -> dict[str, Any]:
    table, storage, container = core.router.table, core.storage, core.container
    sums = {name: _row_sums(array) for name, array in storage.arrays.items()}
    keys = [k for k in table.resident() if table.state(k) == "ready"]
    bad: list[tuple[int, int, int]] = []
    for layer, expert in keys:
        slot = table.lookup((layer, expert))
        assert slot is not None
        fmt, names = storage.layout.layer(None if not storage.layout.mixed else layer)
        blob = np.empty(container.layer(layer).stride, dtype=np.uint8)
        container.read_expert(layer, expert, blob)
        for t in fmt.tensors:
            want = int(blob[t.offset:t.offset + t.nbytes].astype(np.int64).sum())
            if int(sums[names[t.name]][slot]) != want:
                bad.append((layer, expert, slot))
                break
    slots = [s for _, _, s in bad]
    return {"slots": storage.num_slots, "checked": len(keys), "bad": len(bad),
            "bad_slot_range": [min(slots), max(slots)] if slots else None,
            "first_bad": bad[:5]}


async def _one(args: argparse.Namespace, pooled: bool) -> dict[str, Any]:
    from actors.sampling_params import SamplingParams

    extra = {"reader": {"device_copy": args.device_copy}}
    async with engine_for(args.model, args.pool_mb, pooled, extra) as engine:
        if not pooled:
            prompt = prompt_ids(16, engine.facts.vocab_size, 0)
            async for _ in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=args.tokens)):
                pass
        return check(engine._core)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": str(args.model), "streamed": await _one(args, False),
            "pooled": await _one(args, True)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device-copy", default="auto", choices=["auto", "direct", "load", "prefetch"],
                    help="how blobs reach the pool (reader.device_copy): 'load' installs through "
                         "MLX's scatter, whose indexing past 2^31 elements is unchecked on CUDA")
    print(json.dumps(trio.run(main, ap.parse_args())), flush=True)
