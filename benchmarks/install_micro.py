"""Micro-benchmark of pool installs (the H200 timeline's dominant span): the engine's
per-expert PoolStorage.install against one batched scatter per tensor.

    python benchmarks/install_micro.py [preset] [pool_mb]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from actors.pool_storage import _MX_DTYPES, _NP_DTYPES, PoolStorage  # noqa: E402
from qpack.bench_container import expert_layout  # noqa: E402
from qpack.presets import get_preset  # noqa: E402


def batched_install(storage: PoolStorage, items: list[tuple[int, np.ndarray]]) -> None:
    """One host->device copy and one scatter per tensor for all experts of the batch."""
    slots = mx.array([s for s, _ in items], dtype=mx.int32)
    blobs = np.stack([b for _, b in items])
    for t in storage.fmt.tensors:
        raw = np.ascontiguousarray(blobs[:, t.offset : t.offset + t.nbytes]).view(_NP_DTYPES[t.dtype])
        value = mx.array(raw.reshape(len(items), *t.shape))
        if t.dtype == "bfloat16":
            value = value.view(_MX_DTYPES[t.dtype])
        storage.arrays[t.name][slots] = value
    mx.eval(list(storage.arrays.values()))


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.6-35b-a3b"
    pool_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    fmt, stride = expert_layout(get_preset(None if "-" in preset else "qwen3_next", preset), 4, 64)
    slot = sum(t.nbytes for t in fmt.tensors)
    storage = PoolStorage(fmt, pool_mb * 2**20 // slot)
    rng = np.random.default_rng(0)
    blobs = [np.frombuffer(rng.bytes(stride), dtype=np.uint8).copy() for _ in range(16)]
    print(f"device {mx.default_device()} slots {storage.num_slots} slot_mb {slot / 2**20:.2f}")
    for n in (1, 4, 10):
        for name, fn in (("per-expert", storage.install), ("batched", lambda it: batched_install(storage, it))):
            items = [(int(s), blobs[i % len(blobs)]) for i, s in enumerate(rng.choice(storage.num_slots, n, replace=False))]
            fn(items)  # warm-up (JIT)
            mx.reset_peak_memory()
            reps = 20
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(items)
            ms = (time.perf_counter() - t0) / reps * 1000
            print(f"install {name:10s} n={n:2d}: {ms:7.2f} ms/call {ms / n:6.2f} ms/expert "
                  f"peak {mx.get_peak_memory() / 2**20:.0f} MB (pool {storage.nbytes / 2**20:.0f} MB)")


if __name__ == "__main__":
    main()
