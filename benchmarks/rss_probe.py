"""Probe: does device staging cost host memory, and whose?

Stages random expert blobs the way readers do (`PoolStorage.stage` on
`MlxWorker.staging(i)` threads) and installs them in batches on the MLX thread, with
1, 4 and 8 staging threads in turn, printing RSS (the kernel's anon/file/shmem split and
the largest mappings) and MLX's active/cache memory after each phase. No engine, no disk:
what grows here is staging's own.

    python benchmarks/rss_probe.py [preset] [experts per phase] [container]

With a container, its dense core is loaded first (`load_dense`, as an engine does): the
RSS it adds says whether the weights also stay in host memory.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from actors.mlx_worker import MlxWorker  # noqa: E402
from actors.pool.storage import PoolStorage, slots_for_budget  # noqa: E402
from benchmarks.expert_fixture import random_experts  # noqa: E402
from pipeline.models.dense import load_dense  # noqa: E402
from pipeline.resident_map import (  # noqa: E402
    current_rss_mb,  # noqa: E402
    resident_by_mapping,
    resident_kinds,
)
from qpack.reader import Container  # noqa: E402


def report(phase: str, t0: float) -> None:
    mib = 2**20
    print(f"{phase:28s} {time.perf_counter() - t0:6.1f}s rss {current_rss_mb():7.0f} MiB "
          f"{resident_kinds()} mlx active {mx.get_active_memory() / mib:.0f} "
          f"cache {mx.get_cache_memory() / mib:.0f} | {resident_by_mapping(6)}", flush=True)


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.6-35b-a3b"
    per_phase = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    fmt, blobs = random_experts(preset, 32)
    mlx_thread = MlxWorker.shared()
    t0 = time.perf_counter()
    mlx_thread.call(lambda: mx.eval(mx.zeros(1)))
    report("start", t0)
    if len(sys.argv) > 3:
        with Container.open(sys.argv[3], verify="off") as c:
            dense = mlx_thread.call(lambda: load_dense(c.config, c.dense_path))
        size = sum(v.nbytes for _, v in tree_flatten(dense.parameters())) / 2**20
        report(f"dense core ({size:.0f} MiB)", t0)
        mlx_thread.call(mx.clear_cache)
        report("after mx.clear_cache", t0)
    storage = mlx_thread.call(lambda: PoolStorage(fmt, slots_for_budget(fmt, 2**30)))
    report("pool 1 GiB", t0)
    rng = np.random.default_rng(0)
    batch = 16

    def stage(i: int, threads: int) -> mx.array:
        return MlxWorker.staging(i % threads).call(lambda: storage.stage([blobs[i % len(blobs)]])[0])

    for threads in (1, 4, 8, 4):
        with ThreadPoolExecutor(threads) as pool:
            for first in range(0, per_phase, batch):
                staged = list(pool.map(stage, range(first, first + batch), [threads] * batch))
                items = list(zip(map(int, rng.choice(storage.num_slots, batch, replace=False)), staged,
                                 strict=True))
                mlx_thread.call(lambda items=items: storage.install(items))
                del staged, items
        report(f"{per_phase} staged, {threads} threads", t0)
    mlx_thread.call(mx.clear_cache)
    report("after mx.clear_cache", t0)


if __name__ == "__main__":
    main()
