"""`reader.concurrency = "auto"`: the queue depth this disk needs, measured at start.

An NVMe drive delivers its bandwidth only with several reads in flight; how many depends
on the drive, the filesystem and the read size, and too many only queue behind each
other (a demand read then waits longer behind prefetches). So the reader measures:
random expert reads at the expert's own size and the reader's own flags (O_DIRECT or
not), at depths 1, 2, 4, ... `MAX_DEPTH`, a few rounds each, and takes the smallest
depth within `GOOD_ENOUGH` of the best bandwidth seen, and at least `MIN_DEPTH`. The
probe stops early once a doubling stops paying, and stays within about a second and a
half on a disk of ~1 GB/s or faster.

Why not simply "many": on the H200's volume (2026-12-01, 35B dims, O_DIRECT) decode ran
at 3.28 / 3.12-3.54 / 2.91 tok/s with 1 / 2 / 4 readers in one lease: past the depth
the disk needs, each read only takes longer (a demand read's latency is on compute's
critical path). The same volume's bandwidth at a given depth also varied from one probe
to the next (depth 1: 0.88-1.56 GB/s), so the probe's answer is coarse by nature. Once a
probe there saw 0.88 / 0.95 / 1.31 / 1.49 GB/s at 1 / 2 / 4 / 8 and took 8 (the rule was
"within 92 % of the best" then): decode reads took 8.2 ms each and decode fell to 1.95
tok/s. Hence "within 80 %": bandwidth bought with depth must be large to be worth the
latency every demand read pays.

And decode takes at most `DECODE_MAX_DEPTH`. Until session 17 the probe timed fresh
buffers and thread start-up with a dozen reads per thread, so depth 2 always measured
below depth 1 and the probe stopped there: decode ran with 2 threads everywhere. Measured
properly, the page cache scales to depth 8 (2.2 / 13.5 / 24.4 / 34.4 GB/s at 1 / 2 / 4 /
8), but decode from it ran 4.23 tok/s with 8 readers against 5.41 with 2 (H200, one
lease; 5.09 against 5.63 in session 15): each thread's reads cost the event loop and the
GIL, and a token's reads come a layer's worth at a time. The curve still sizes the
prefill's bulk lane (`best`), where bandwidth is what counts.

The answer is kept per (container, O_DIRECT) for the process: engines reopened on the
same container (tests, a server's restarts of its engine) do not probe again.
"""

from __future__ import annotations

import random
import threading
import time

import msgspec
import numpy as np
import structlog

from qpack.reader import Container, aligned_empty

log = structlog.get_logger("moestream.reader")

MIN_DEPTH = 2  # a demand read can start while a prefetch is in flight
DECODE_MAX_DEPTH = 2  # see the module docstring
MAX_DEPTH = 16
ROUNDS = 24  # reads per thread at each depth
GOOD_ENOUGH = 0.8  # of the best bandwidth: the smallest depth that reaches it
GAIN = 1.05  # a doubling that adds less than this stops the probe
BUDGET_S = 1.5
_cache: dict[tuple[str, bool], DepthProbe] = {}
_lock = threading.Lock()


class DepthProbe(msgspec.Struct, frozen=True):
    depth: int  # decode's
    gb_s: dict[int, float]  # depth -> measured GB/s
    seconds: float

    @property
    def best(self) -> int:
        """The depth of the best bandwidth measured (a prompt's reads want it)."""
        return max(self.gb_s, key=lambda depth: self.gb_s[depth], default=self.depth)


def choose_depth(container: Container) -> DepthProbe:
    """The queue depth for this container's disk (measured once per process)."""
    key = (str(container.root.resolve()), container.o_direct)
    with _lock:
        probe = _cache.get(key)
        if probe is None:
            probe = _cache[key] = _probe(container)
            log.info("reader.queue_depth", depth=probe.depth, seconds=round(probe.seconds, 2),
                     gb_s={d: round(v, 2) for d, v in probe.gb_s.items()})
        return probe


def _probe(engine_container: Container) -> DepthProbe:
    # Its own descriptors, closed after: the engine's container opens a layer's file on
    # its first read, as before (a file made unreadable later is then found by that
    # read), and an injected ExpertIO (tests' faults) is not spent on the probe.
    with Container.open(engine_container.root, verify="off",
                        o_direct=engine_container.o_direct) as container:
        return _measure(container)


def _measure(container: Container) -> DepthProbe:
    started = time.perf_counter()
    m = container.manifest
    keys = [(entry.index, e) for entry in m.layers for e in range(entry.num_experts)]
    rng = random.Random(0)
    rng.shuffle(keys)
    total = len(keys)
    nxt = 0
    measured: dict[int, float] = {}
    buffers: list[np.ndarray] = []
    depth = 1
    while depth <= MAX_DEPTH:
        while len(buffers) < depth:
            buffers.append(aligned_empty(m.max_stride))
            buffers[-1].fill(0)  # its pages faulted in now, not inside a timed read
        want = depth * ROUNDS
        batch = [keys[(nxt + i) % total] for i in range(want)]
        nxt += want
        measured[depth] = _bandwidth(container, batch, depth, buffers)
        spent = time.perf_counter() - started
        if depth > 1 and measured[depth] < measured[depth // 2] * GAIN:
            break
        if spent > BUDGET_S:
            break
        depth *= 2
    best = max(measured.values())
    chosen = min(d for d, v in measured.items() if v >= GOOD_ENOUGH * best)
    return DepthProbe(max(MIN_DEPTH, min(DECODE_MAX_DEPTH, chosen)), measured,
                      time.perf_counter() - started)


def _bandwidth(container: Container, keys: list[tuple[int, int]], depth: int,
               buffers: list[np.ndarray]) -> float:
    """GB/s of reading `keys` with `depth` threads, each one read in flight at a time.

    Timed from when every thread is ready, into buffers faulted in beforehand: with
    fresh buffers and thread start-up inside the clock, a dozen reads per thread made
    depth 2 look slower than depth 1 on every disk (H200, session 17: 0.76-1.03 against
    1.30-1.65 GB/s cold, 1.3-4.1 against 4.0-5.0 on the page cache), and the probe never
    looked deeper."""
    lock = threading.Lock()
    todo = list(keys)
    nbytes = [0]
    ready = threading.Barrier(depth + 1)

    def run(buf: np.ndarray) -> None:
        ready.wait()
        while True:
            with lock:
                if not todo:
                    return
                layer, expert = todo.pop()
            container.read_expert(layer, expert, buf, check=False)
            with lock:
                nbytes[0] += container.manifest.layer(layer).stride

    threads = [threading.Thread(target=run, args=(buffers[i],), daemon=True) for i in range(depth)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return nbytes[0] / max(time.perf_counter() - start, 1e-9) / 1e9
