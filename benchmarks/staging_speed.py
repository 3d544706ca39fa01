"""How fast expert blobs reach device memory through `device_staging` (issue "Keep the
disk busy"): seconds per blob for one blob per `mx.load` and for batches, on 1-4
staging threads at once, before and after glibc is told to keep large blocks in its
heap (M_MMAP_THRESHOLD: MLX's `Load` mallocs a fresh host buffer per load, which glibc
serves from new, page-faulting mmap pages), beside a plain host memcpy of the same size.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/staging_speed.py [--mb 1.77] [--blobs 256]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from actors.device_staging import to_device, to_device_many  # noqa: E402
from actors.mlx_worker import MlxWorker  # noqa: E402


def run(blobs: list[np.ndarray], threads: int, batch: int) -> float:
    """Seconds per blob, `threads` staging threads each staging its share in `batch`es."""
    shares = [blobs[i::threads] for i in range(threads)]

    def work(share: list[np.ndarray]) -> None:
        for i in range(0, len(share), batch):
            part = share[i : i + batch]
            out = [to_device(part[0])] if batch == 1 else to_device_many(part)
            del out

    done = [threading.Event() for _ in range(threads)]
    t0 = time.perf_counter()
    for i, share in enumerate(shares):
        MlxWorker.staging(i).submit(lambda share=share, i=i: (work(share), done[i].set()))
    for event in done:
        event.wait()
    return (time.perf_counter() - t0) / len(blobs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=1.77)
    ap.add_argument("--blobs", type=int, default=256)
    args = ap.parse_args()
    nbytes = int(args.mb * 2**20)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(16)]
    blobs = [blobs[i % 16] for i in range(args.blobs)]
    print(f"device {mx.default_device()}, blob {nbytes / 2**20:.2f} MiB, {args.blobs} blobs")
    dst = np.empty(nbytes, np.uint8)
    t0 = time.perf_counter()
    for b in blobs:
        np.copyto(dst, b)
    per = (time.perf_counter() - t0) / len(blobs)
    print(f"host memcpy (warm buffer): {per * 1e3:.3f} ms/blob = {nbytes / per / 1e9:.2f} GB/s")
    t0 = time.perf_counter()
    for b in blobs[:64]:
        fresh = np.empty(nbytes, np.uint8)
        np.copyto(fresh, b)
        del fresh
    per = (time.perf_counter() - t0) / 64
    print(f"host memcpy (fresh buffer): {per * 1e3:.3f} ms/blob = {nbytes / per / 1e9:.2f} GB/s")
    run(blobs[:8], 1, 1)  # warm the threads' streams
    for label in ("default malloc", "M_MMAP_THRESHOLD=256MiB"):
        if label != "default malloc":
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 256 * 2**20)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 512 * 2**20)  # M_TRIM_THRESHOLD
        for threads in (1, 2, 4):
            for batch in (1, 8):
                per = run(blobs, threads, batch)
                print(f"{label:24} threads {threads} batch {batch:2}: {per * 1e3:.3f} ms/blob "
                      f"= {nbytes / per / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    import os

    os._exit(0)  # the staging threads live for the process: skip their teardown
