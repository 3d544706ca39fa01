"""Expert reads while another thread runs Python: the reader's threads against its ring.

    python benchmarks/reads_under_gil.py CONTAINER [--reads 400] [--depths 2,8] [--busy 0,1]

In the engine a disk thread's pread releases the GIL, but its return into Python waits
for it behind the event loop, the MLX thread's graph building and the staging threads
(session 26's H200 timeline: a page-cache read whose copy takes ~0.26 ms took ~0.47).
This measures that wait alone: random whole-blob reads of the container's experts from
the page cache, through the real `ExpertReader` (its queues, buffers and hand-over to trio;
no checksum, no staging), `depth` reads in flight as threads (`io = "threads"`) or as one
io_uring (`"uring"`), while `busy` threads run pure Python (a loop that holds the GIL but
for the switch interval). Prints GB/s and each read's time from its start to its
return into trio (median, 90th percentile). Linux; no MLX model, no GPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from actors.reader import ExpertReader  # noqa: E402
from qpack.reader import Container  # noqa: E402


def spin(stop: threading.Event) -> None:
    """Pure Python: holds the GIL but for the interpreter's switch interval."""
    n = 0
    while not stop.is_set():
        for i in range(2000):
            n += i * i % 7


async def run(container: Container, keys: list[tuple[int, int]], depth: int, io: str,
              busy: int) -> tuple[float, list[float], str]:
    reader = ExpertReader(container, concurrency=depth, io=io, buffers=2 * depth)
    stop = threading.Event()
    spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    for t in spinners:
        t.start()
    took: list[float] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            started = time.perf_counter()
            pending = list(keys)
            flying = []
            while pending or flying:
                while pending and len(flying) < 2 * depth:
                    flying.append(reader.submit(pending.pop(), demand=False))
                await reader.wait_any()
                for load in [f for f in flying if f.done.is_set()]:
                    flying.remove(load)
                    assert load.error is None, load.error
                    took.append(time.perf_counter() - load.t_start)
                    reader.give_back(load.buffer)
            wall = time.perf_counter() - started
            nursery.cancel_scope.cancel()
    finally:
        stop.set()
        for t in spinners:
            t.join()
    stride = container.manifest.max_stride
    return len(keys) * stride / wall / 1e9, took, reader.io


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", type=Path)
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--depths", default="2,8")
    ap.add_argument("--busy", default="0,1", help="pure-Python threads beside the reads")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with Container.open(args.container, verify="off") as c:
        keys = [(layer, e) for layer in c.moe_layers for e in range(c.layer(layer).num_experts)]
        for key in keys:  # every blob in the page cache first
            c.read_expert(*key, bytearray(c.manifest.max_stride), check=False)
        print(f"{len(keys)} experts of {c.manifest.max_stride / 2**20:.2f} MiB in the page cache; "
              f"{args.reads} random reads a run; GIL switch interval {sys.getswitchinterval() * 1e3:.1f} ms "
              "(the reader shortens it while it runs)")
        print("busy  depth  io       GB/s   read ms median / p90")
        for busy in (int(b) for b in args.busy.split(",")):
            for depth in (int(d) for d in args.depths.split(",")):
                for io in ("threads", "uring"):
                    rates, times, ran = [], [], io
                    for r in range(args.rounds):
                        picks = random.Random(r).choices(keys, k=args.reads)
                        rate, took, ran = trio.run(run, c, picks, depth, io, busy)
                        rates.append(rate)
                        times.extend(took)
                    times.sort()
                    print(f"{busy:4d}  {depth:5d}  {ran:7s}  {statistics.median(rates):5.2f}   "
                          f"{1e3 * statistics.median(times):.3f} / {1e3 * times[int(0.9 * (len(times) - 1))]:.3f}")


if __name__ == "__main__":
    main()
