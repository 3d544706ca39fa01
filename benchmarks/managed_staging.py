"""Expert blobs to the GPU by managed memory and a bulk prefetch (issue "Keep the disk busy",
the fast-disk case) against today's path, alone and beside a busy MLX thread (as in the
engine), on 1/2/4 staging threads; 1.77 MiB blobs (a 35B expert).

- load:     `device_staging.to_device` (npy view -> MLX's Load -> a pageable copy)
- fault:    `mx.array(numpy)` (managed memory); the first kernel pulls it by page faults
- prefetch: `device_staging.to_device_prefetched` (managed memory, `cuMemPrefetchAsync`)

Each blob is then read by one kernel (`+ 0`), as an install reads it.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/managed_staging.py
"""

from __future__ import annotations

import sys
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from actors import cuda_prefetch  # noqa: E402
from actors.device_staging import to_device, to_device_prefetched  # noqa: E402
from actors.mlx_worker import MlxWorker  # noqa: E402


def _one(variant: str, blob: np.ndarray) -> mx.array:
    if variant == "load":
        return to_device(blob) + 0
    if variant == "fault":
        return mx.array(blob) + 0
    return to_device_prefetched([blob])[0] + 0


def run(blobs: list[np.ndarray], threads: int, variant: str) -> float:
    shares = [blobs[i::threads] for i in range(threads)]

    def work(share: list[np.ndarray], done: threading.Event) -> None:
        for blob in share:
            out = _one(variant, blob)
            mx.eval(out)
            del out
        done.set()

    done = [threading.Event() for _ in range(threads)]
    t0 = time.perf_counter()
    for i, share in enumerate(shares):
        MlxWorker.staging(i).submit(partial(work, share, done[i]))
    for event in done:
        event.wait()
    return (time.perf_counter() - t0) / len(blobs)


def main() -> None:
    nbytes = int(1.77 * 2**20)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(16)]
    blobs = [blobs[i % 16] for i in range(256)]
    print("prefetch usable:", MlxWorker.staging(0).call(cuda_prefetch.usable), flush=True)
    w = mx.random.normal((2048, 2048))
    stop = threading.Event()

    def busy() -> None:  # the engine's MLX thread: launches and syncs, on its own stream
        with mx.stream(mx.new_stream(mx.gpu)):
            while not stop.is_set():
                mx.eval(w @ w)

    for variant in ("load", "fault", "prefetch"):
        run(blobs[:8], 1, variant)
        for label, beside in (("alone", False), ("beside compute", True)):
            th = threading.Thread(target=busy) if beside else None
            if th:
                stop.clear()
                th.start()
            for threads in (1, 2, 4):
                per = run(blobs, threads, variant)
                print(f"{variant:9} {label:15} threads {threads}: {per * 1e3:.3f} ms/blob "
                      f"= {nbytes / per / 1e9:.2f} GB/s", flush=True)
            if th:
                stop.set()
                th.join()
    same = MlxWorker.staging(0).call(
        lambda: bool(mx.all(to_device_prefetched([blobs[3]])[0] == mx.array(blobs[3])).item()))
    assert same, "prefetched bytes differ"
    print("bytes intact", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    import os

    os._exit(0)  # the staging threads live for the process: skip their teardown
