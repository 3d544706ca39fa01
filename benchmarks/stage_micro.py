"""Micro-benchmark: where should an expert blob become an MLX array?

(a) on the MLX thread, one batched install per layer (`PoolStorage.install` of numpy blobs);
(b) in the readers' threads as `mx.array(blob)` (managed memory), 4 threads at once, then
    the batched scatter on the MLX thread;
(c) in the readers' threads by `PoolStorage.stage` (`mx.load` of an npy view: device
    memory, one DMA), then the batched scatter. Also checks (c) puts the same bytes in the pool.

    python benchmarks/stage_micro.py [preset] [pool_mb] [batch]
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from actors.pool.storage import PoolStorage, slot_bytes, slots_for_budget  # noqa: E402
from benchmarks.expert_fixture import random_experts  # noqa: E402


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.6-35b-a3b"
    pool_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    fmt, blobs = random_experts(preset, 64)
    slot = slot_bytes(fmt)
    storage = PoolStorage(fmt, slots_for_budget(fmt, pool_mb * 2**20))
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()} slots {storage.num_slots} expert {slot / 2**20:.2f} MiB")
    reps = 12
    with ThreadPoolExecutor(4) as pool:
        stagers = {"reader-array": lambda b: mx.array(b[: fmt.nbytes]), "reader-load": storage.stage}
        for name in ("mlx-thread", "reader-array", "reader-load") * 2:
            t0 = time.perf_counter()
            for r in range(reps):
                chosen = rng.choice(storage.num_slots, batch, replace=False)
                items = [(int(s), blobs[(r * batch + i) % len(blobs)]) for i, s in enumerate(chosen)]
                if name in stagers:
                    staged = list(pool.map(stagers[name], [b for _, b in items]))
                    storage.install([(s, a) for (s, _), a in zip(items, staged, strict=True)])
                else:
                    storage.install(items)
            dt = (time.perf_counter() - t0) / (reps * batch)
            print(f"{name:15s} {dt * 1e3:6.2f} ms/expert  {slot / dt / 1e9:5.2f} GB/s")
        slot0, blob = int(chosen[0]), items[0][1]
        for t in fmt.tensors:
            got = np.asarray(storage.arrays[t.name][slot0].view(mx.uint8)).tobytes()
            assert got == blob[t.offset : t.offset + t.nbytes].tobytes(), t.name
        print("pool bytes equal the blob: ok")


if __name__ == "__main__":
    main()
