"""The direct install (actors/cuda_direct.py) against today's "load" path, on a real
container, on the GPU: does the probe pass, do both paths leave the same bytes in the
pool, and what does an expert cost each way (read excluded: the blobs are in memory).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/direct_copy_check.py C.qpack [--blobs 64]

"load": a staging thread's `storage.stage` (npy view -> MLX Load) then the MLX thread's
`storage.install` (stack + scatter per tensor); "direct": `storage.install_direct` from
page-locked buffers (one DMA per tensor). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from actors import cuda_direct  # noqa: E402
from actors.mlx_worker import MlxWorker  # noqa: E402
from actors.pool.layout import PoolLayout  # noqa: E402
from actors.pool.storage import PoolStorage  # noqa: E402
from qpack.reader import Container, aligned_empty  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--blobs", type=int, default=64)
    args = ap.parse_args()
    c = Container.open(args.container)
    m = c.manifest
    layout = PoolLayout.of(m.layers)
    keys = [(e.index, x) for e in m.layers for x in range(m.num_experts)][: args.blobs]
    blobs = []
    for key in keys:
        buf = aligned_empty(m.max_stride)
        c.read_expert(*key, buf)
        blobs.append(buf)
    worker = MlxWorker.shared()
    slots = len(keys) + 8
    load_pool = worker.call(lambda: PoolStorage(layout, slots))
    direct_pool = worker.call(lambda: PoolStorage(layout, slots))
    writer = worker.call(lambda: cuda_direct.probe(direct_pool.arrays))
    out: dict[str, object] = {"probe": writer is not None, "blob_mb": m.max_stride / 2**20,
                              "blobs": len(keys), "device": str(mx.default_device())}
    pinned = [cuda_direct.pin(b) for b in blobs] if writer is not None else []
    out["pinned"] = sum(pinned)
    items = list(zip(range(3, 3 + len(keys)), blobs, strict=True))
    for batch in (1, 8):
        t0 = time.perf_counter()
        for i in range(0, len(items), batch):
            part = items[i : i + batch]
            staged = MlxWorker.staging(0).call(lambda p=part: load_pool.stage([b for _, b in p]))
            worker.call(lambda p=part, s=staged: load_pool.install(list(zip([x for x, _ in p], s, strict=True))))
        out[f"load_ms_per_blob_batch{batch}"] = (time.perf_counter() - t0) * 1000 / len(items)
        if writer is not None:
            direct_pool.direct = writer
            t0 = time.perf_counter()
            for i in range(0, len(items), batch):
                worker.call(lambda p=items[i : i + batch]: direct_pool.install_direct(p))
            out[f"direct_ms_per_blob_batch{batch}"] = (time.perf_counter() - t0) * 1000 / len(items)
    if writer is not None:
        same = worker.call(lambda: all(
            bool(mx.array_equal(load_pool.arrays[n], direct_pool.arrays[n]).item()) for n in layout.arrays))
        out["identical"] = same
        secs = out["direct_ms_per_blob_batch8"]
        out["direct_gb_s_batch8"] = m.max_stride / (float(secs) / 1000) / 1e9  # type: ignore[arg-type]
    print(json.dumps(out), flush=True)
    c.close()


if __name__ == "__main__":
    main()
