"""Where the event loop's time goes while the engine decodes: a sampling profile of trio's
thread alone (any backend; Python 3.12's cProfile sees every thread at once, session 26).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/loop_sampler.py CONTAINER \
        [--tokens 32] [--pool-mb 1024] [--slots N] [--io threads] [--interval-ms 0.5]

On the H200's page cache the event loop spent 62-79 ms of CPU in a ~110 ms token and
shares the GIL with the MLX thread and every read's return (docs/results.md, seventeenth
pass). A thread wakes every `--interval-ms`, takes the event loop's stack
(`sys._current_frames`) and counts, for each sample, the innermost frame of the project's
code (`actors/`, `pipeline/`, `qpack/`) with its line, and the innermost frame of all
(trio's epoll wait, a `time.sleep` in a poll, ...: what the loop was doing). Run on a
warm page cache (the container's experts are read once first); prints the two tables and
the event loop's CPU time a token. The sampler needs the GIL to take a sample, so it
sees the event loop where it lets the GIL go (an epoll wait, a `time.sleep`, a lock) or
where the switch interval takes it away: a map of where the loop waits and gives way,
not a CPU profile (its CPU time a token is the line above the tables). Session 27 on the
project VM: 20.6 % of the samples in `ExpertReader.hand_over`'s `time.sleep(0)`, the
event loop waiting to get the GIL back (now off by default).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from actors.sampling_params import SamplingParams  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402
from pipeline.engine import open_engine  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
OURS = tuple(f"{ROOT}/{d}/" for d in ("actors", "pipeline", "qpack"))
PROMPT = [970, 11, 1879, 0, 151, 3000, 77, 1234, 5, 6, 7, 8, 13, 21, 34, 55]


def where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename.removeprefix(ROOT + '/')}:{code.co_name}:{frame.f_lineno}"


class Sampler:
    def __init__(self, ident: int, interval_s: float) -> None:
        self.ident, self.interval_s = ident, interval_s
        self.ours: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="loop-sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.ident)
            if frame is None:
                continue
            self.samples += 1
            self.leaf[where(frame)] += 1
            f: FrameType | None = frame
            while f is not None and not f.f_code.co_filename.startswith(OURS):
                f = f.f_back
            self.ours[where(f) if f is not None else "(outside the project)"] += 1


def table(title: str, counts: collections.Counter[str], total: int, top: int) -> None:
    print(f"{title} ({total} samples)")
    for name, n in counts.most_common(top):
        print(f"  {100 * n / total:5.1f} %  {name}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=0)
    ap.add_argument("--io", default="threads")
    ap.add_argument("--device-wait", default="auto")
    ap.add_argument("--interval-ms", type=float, default=0.5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for blob in Path(args.container, "experts").iterdir():  # the page cache: the fast disk
        with open(blob, "rb") as f:
            while f.read(1 << 24):
                pass
    pool = {"slots": args.slots} if args.slots else {"budget_mb": args.pool_mb}
    cfg = config_from_dict({"model": {"path": args.container, "verify": "off"}, "pool": pool,
                            "reader": {"io": args.io},
                            "compute": {"device_wait": args.device_wait}})
    async with open_engine(cfg) as engine:
        warm = SamplingParams(temperature=1.0, seed=1, max_tokens=4)
        async for _ in engine.generate(list(reversed(PROMPT)), warm):
            pass
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=args.tokens)
        cpu, wall = time.thread_time(), time.perf_counter()
        with Sampler(threading.get_ident(), args.interval_ms / 1e3) as sampler:
            async for _ in engine.generate(PROMPT, params):
                pass
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        print(f"{args.tokens} tokens in {wall:.2f} s ({args.tokens / wall:.2f} tok/s); the event loop's "
              f"CPU {1e3 * cpu / args.tokens:.1f} ms a token of {1e3 * wall / args.tokens:.1f}; "
              f"reads {engine.facts.reader_io}")
    table("innermost frame", sampler.leaf, sampler.samples, args.top)
    table("innermost project frame", sampler.ours, sampler.samples, args.top)


if __name__ == "__main__":
    trio.run(main)
