"""io_uring against the reader's threads, for a container's expert reads (issue 31: "use
io_uring where the platform has it if it measurably beats threads").

    python benchmarks/uring_vs_threads.py CONTAINER [--depths 1,2,4,8] [--reads 400] [--cached]

Random whole-blob reads of the container's experts (one `stride` each, as the reader
issues them), at each queue depth, two ways: `depth` threads each keeping one blocking
`os.preadv` in flight (the reader actor's path), and one thread keeping `depth` reads in
flight through an io_uring (IORING_OP_READ, driven with ctypes: no third-party binding),
reaping one or more completions per `io_uring_enter`; and the same with IOSQE_ASYNC (a
cached read is otherwise copied inline, on the submitting thread). O_DIRECT unless `--cached` (the page
cache: a fast disk's stand-in). The two alternate, several rounds, so a drifting disk
drifts for both; each line is a median. Linux only; no MLX, no engine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qpack.reader import Container, aligned_empty  # noqa: E402
from qpack.uring import Ring  # noqa: E402


def _targets(root: Path, reads: int, seed: int) -> tuple[list[tuple[str, int]], int]:
    """(file, offset) of `reads` random expert blobs, and the stride (the largest)."""
    manifest = Container.open(root, verify="off").manifest
    layers = [manifest.layer(i) for i in range(manifest.num_layers)]
    rng = random.Random(seed)
    picks = []
    for _ in range(reads):
        entry = rng.choice(layers)
        picks.append((str(root / entry.file), rng.randrange(entry.num_experts) * entry.stride))
    return picks, max(e.stride for e in layers)


def _open_all(picks: list[tuple[str, int]], direct: bool) -> dict[str, int]:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    return {path: os.open(path, flags) for path in {p for p, _ in picks}}


def threads(picks: list[tuple[str, int]], fds: dict[str, int], stride: int, depth: int) -> float:
    """GB/s with `depth` threads, each one blocking pread in flight (the reader's way)."""
    lock, it = threading.Lock(), iter(picks)

    def work() -> None:
        buf = aligned_empty(stride)
        while True:
            with lock:
                pick = next(it, None)
            if pick is None:
                return
            os.preadv(fds[pick[0]], [memoryview(buf)], pick[1])

    pool = [threading.Thread(target=work) for _ in range(depth)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return len(picks) * stride / (time.perf_counter() - start) / 1e9


def uring(picks: list[tuple[str, int]], fds: dict[str, int], stride: int, depth: int,
          force_async: bool = False) -> float:
    """GB/s with one thread keeping `depth` reads in flight through an io_uring."""
    ring = Ring(max(depth, 2))
    bufs = [aligned_empty(stride) for _ in range(depth)]
    pending = list(reversed(picks))
    free, in_flight = list(range(depth)), 0
    start = time.perf_counter()
    try:
        while pending or in_flight:
            submit = 0
            while free and pending:
                path, offset = pending.pop()
                slot = free.pop()
                ring.read(fds[path], bufs[slot].ctypes.data, stride, offset, slot, on_workers=force_async)
                submit += 1
            in_flight += submit
            ring.enter(1)
            for slot, res in ring.reap():
                if res < 0:
                    raise OSError(-res, os.strerror(-res))
                free.append(slot)
                in_flight -= 1
    finally:
        ring.close()
    return len(picks) * stride / (time.perf_counter() - start) / 1e9


def same_bytes(picks: list[tuple[str, int]], fds: dict[str, int], stride: int) -> bool:
    """The ring reads what preadv reads (the first few blobs)."""
    ring, ok = Ring(2), True
    try:
        for path, offset in picks[:8]:
            a, b = aligned_empty(stride), aligned_empty(stride)
            os.preadv(fds[path], [memoryview(a)], offset)
            ring.read(fds[path], b.ctypes.data, stride, offset, 0, on_workers=False)
            ring.enter(1)
            (tag, res), = ring.reap()
            ok = ok and res == stride and bool((a == b).all())
    finally:
        ring.close()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", type=Path)
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cached", action="store_true", help="through the page cache (no O_DIRECT)")
    args = ap.parse_args()
    picks, stride = _targets(args.container, args.reads, seed=0)
    fds = _open_all(picks, direct=not args.cached)
    if args.cached:  # warm the page cache with every blob read once
        threads(picks, fds, stride, 4)
    if not same_bytes(picks, fds, stride):
        raise SystemExit("io_uring read other bytes than preadv: not measuring")
    print(f"{len(picks)} reads of {stride / 2**20:.2f} MiB, {'page cache' if args.cached else 'O_DIRECT'}")
    print("depth  threads GB/s  io_uring GB/s  io_uring async GB/s  (medians of", args.rounds, "rounds)")
    for depth in (int(d) for d in args.depths.split(",")):
        t, u, a = [], [], []
        for r in range(args.rounds):  # alternate, and each round its own random order
            order = random.Random(r).sample(picks, len(picks))
            t.append(threads(order, fds, stride, depth))
            u.append(uring(order, fds, stride, depth))
            a.append(uring(order, fds, stride, depth, force_async=True))
        print(f"{depth:5d}  {statistics.median(t):12.2f}  {statistics.median(u):13.2f}"
              f"  {statistics.median(a):19.2f}")
    for fd in fds.values():
        os.close(fd)


if __name__ == "__main__":
    main()
