"""The device wait's pulled installs on their own (actors/device_wait.py): a wait answered
at once by a host thread, with and without copies from page-locked blobs into an MLX
array (the pool's stand-in), against the same bytes by DMA (`cuMemcpyHtoDAsync`, the
direct install). Checks the bytes the GPU pulled; prints ms and GB/s. Seconds on a GPU:
run it before a bench of `--device-wait auto`.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/pull_probe.py [--blobs 8] [--mib 1.77] [--rounds 10]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from actors.cuda_direct import DirectWriter, pin  # noqa: E402
from actors.device_wait import Copy, DeviceWait  # noqa: E402


def waited(wait: DeviceWait, copies: list[Copy]) -> float:
    """One wait answered by a host thread with `copies`; seconds until MLX returns."""
    seq = wait.next_seq()
    wait.begin()
    slots = wait.wait_slots(0, seq, mx.array([[1, 2, 3]], dtype=mx.int32))

    def host() -> None:
        while not wait.published(0, seq):
            time.sleep(1e-5)
        wait.append(0, copies)
        wait.answer(0, seq, np.array([5, 6, 7], dtype=np.int32))

    helper = threading.Thread(target=host)
    helper.start()
    start = time.perf_counter()
    mx.eval(slots)
    took = time.perf_counter() - start
    helper.join()
    assert slots.tolist() == [[5, 6, 7]], slots
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blobs", type=int, default=8)
    ap.add_argument("--mib", type=float, default=1.77)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    size = int(args.mib * 2**20) // 16 * 16
    target = mx.zeros((args.blobs, size), dtype=mx.uint8)
    mx.eval(target)
    writer = DirectWriter({"pool": target})
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.blobs)]
    for blob in blobs:
        pin(blob)
    copies = [(writer.base["pool"] + i * size, blob.ctypes.data, size) for i, blob in enumerate(blobs)]
    wait = DeviceWait(1)
    waited(wait, copies)  # compiles the kernels
    bare = sorted(waited(wait, []) for _ in range(args.rounds))[args.rounds // 2]
    pulled = sorted(waited(wait, copies) for _ in range(args.rounds))[args.rounds // 2]
    same = all(np.array_equal(np.asarray(target[i]), blob) for i, blob in enumerate(blobs))
    mx.eval(target * 0)  # the DMA's target must not be read by anything queued
    dma = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        writer.write_now(copies)
        dma.append(time.perf_counter() - start)
    total = args.blobs * size
    print(f"wait alone {1e3 * bare:.3f} ms; with {args.blobs} x {size / 2**20:.2f} MiB pulled "
          f"{1e3 * pulled:.3f} ms ({total / max(pulled - bare, 1e-9) / 1e9:.1f} GB/s for the copies), "
          f"bytes {'equal' if same else 'DIFFER'}; by DMA {1e3 * sorted(dma)[len(dma) // 2]:.3f} ms "
          f"({total / sorted(dma)[len(dma) // 2] / 1e9:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
