"""How long a woken disk thread waits for the GIL behind the event loop's Python, with and
without a hand-over (`ExpertReader.hand_over`: `time.sleep(0)` after a batch of submits).

Two threads wait on a condition as the reader's disk threads do; the main thread queues
two items, notifies, then runs `--busy-us` of Python (as the router goes on placing a
layer's predictions, the compute task answering, the prefetch task predicting) before it
sleeps. The switch interval is the reader's (0.2 ms). Prints the median and 90th
percentile of the time from the notify to a thread's start, each way, twice.

    python benchmarks/gil_handover.py [--busy-us 400] [--rounds 200]

This VM (2 cores, Python 3.11), 2026-12-04: 346 / 335 us without, 41 / 34 us with.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import deque


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy-us", type=float, default=400.0)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    sys.setswitchinterval(0.0002)  # actors/switch_interval.py
    cond = threading.Condition()
    queue: deque[float | None] = deque()
    starts: list[float] = []

    def disk_thread() -> None:
        while True:
            with cond:
                while not queue:
                    cond.wait()
                queued = queue.popleft()
            if queued is None:
                return
            starts.append(time.perf_counter() - queued)
            time.sleep(0.0003)  # the pread, the GIL released

    threads = [threading.Thread(target=disk_thread) for _ in range(2)]
    for t in threads:
        t.start()

    def busy() -> None:
        end = time.perf_counter() + args.busy_us / 1e6
        while time.perf_counter() < end:
            pass

    for mode in ("without", "with", "without", "with"):
        starts.clear()
        for _ in range(args.rounds):
            with cond:
                now = time.perf_counter()
                queue.extend((now, now))
                cond.notify_all()
            if mode == "with":
                time.sleep(0)  # the hand-over
            busy()
            time.sleep(0.001)
        ordered = sorted(starts)
        print(f"{mode:8s} hand-over: a woken thread starts {1e6 * statistics.median(ordered):.0f} us "
              f"after the notify (90 %: {1e6 * ordered[int(0.9 * len(ordered))]:.0f} us)")
    with cond:
        queue.extend((None, None))
        cond.notify_all()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
