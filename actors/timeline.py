"""A Chrome/Perfetto timeline of the pipeline: one track per actor, one span per step.

    with timeline.recording("out.json"):      # or Timeline() + timeline.activate(tl)
        ... run the engine ...

Actors mark their work with `with timeline.span("reader-0", "read", layer=3): ...`.
While nothing records, `span` returns one shared no-op context manager: the cost in
the hot path is a global lookup and a call, so the spans can stay in the code.

The file is the Trace Event Format's JSON object form ({"traceEvents": [...]}) with
complete ("X") events in microseconds and `thread_name` metadata naming each track,
which both chrome://tracing and ui.perfetto.dev open.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from qpack.output_guard import write_file_atomically

PID = 1
# Fixed track order (tid) so every trace reads top-down the same way; readers follow.
_FIXED_TIDS = {"compute": 1, "router": 2, "sampler": 3}
_READER_BASE = 10
_NOOP: AbstractContextManager[None] = nullcontext()


class Timeline:
    """Collects complete events; safe to append from worker threads (list.append is atomic)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter_ns()
        self.events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = dict(_FIXED_TIDS)
        self._lock = threading.Lock()

    def tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            with self._lock:
                tid = self._tids.get(track)
                if tid is None:
                    if track.startswith("reader-") and track[7:].isdigit():
                        tid = _READER_BASE + int(track[7:])
                    else:
                        tid = 100 + len(self._tids)
                    self._tids[track] = tid
        return tid

    def now_us(self) -> float:
        return (time.perf_counter_ns() - self.t0) / 1000.0

    @contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            self.add(track, name, (start - self.t0) / 1000.0, (end - start) / 1000.0, args)

    def add(self, track: str, name: str, ts_us: float, dur_us: float,
            args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"name": name, "ph": "X", "pid": PID, "tid": self.tid(track),
                                 "ts": round(ts_us, 3), "dur": round(dur_us, 3)}
        if args:
            event["args"] = args
        self.events.append(event)

    def instant(self, track: str, name: str, **args: Any) -> None:
        event: dict[str, Any] = {"name": name, "ph": "i", "s": "t", "pid": PID,
                                 "tid": self.tid(track), "ts": round(self.now_us(), 3)}
        if args:
            event["args"] = args
        self.events.append(event)

    def counter(self, name: str, **values: float) -> None:
        """A counter track's new value(s) from now on (Perfetto draws it as a graph)."""
        self.events.append({"name": name, "ph": "C", "pid": PID, "ts": round(self.now_us(), 3),
                            "args": values})

    def to_json(self) -> dict[str, Any]:
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "moestream"}}
        ]
        for track, tid in sorted(self._tids.items(), key=lambda kv: kv[1]):
            meta.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid,
                         "args": {"name": track}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                         "args": {"sort_index": tid}})
        return {"traceEvents": meta + sorted(self.events, key=lambda e: e["ts"]),
                "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> Path:
        # Whole or absent, and no directory made for it (checked before the run:
        # qpack.output_guard.check_output_file).
        return write_file_atomically(path, json.dumps(self.to_json()).encode())


_active: Timeline | None = None


def active() -> Timeline | None:
    return _active


def activate(tl: Timeline | None) -> Timeline | None:
    """Make `tl` the recording timeline (None stops recording); returns the previous one."""
    global _active
    prev, _active = _active, tl
    return prev


def span(track: str, name: str, **args: Any) -> AbstractContextManager[None]:
    """A span on `track` while a timeline records; a shared no-op otherwise."""
    tl = _active
    if tl is None:
        return _NOOP
    return tl.span(track, name, **args)


def counter(name: str, **values: float) -> None:
    """A counter sample while a timeline records (the disk's reads in flight)."""
    tl = _active
    if tl is not None:
        tl.counter(name, **values)


def instant(track: str, name: str, **args: Any) -> None:
    """An instant event on `track` while a timeline records."""
    tl = _active
    if tl is not None:
        tl.instant(track, name, **args)


@contextmanager
def recording(path: str | os.PathLike[str] | None) -> Iterator[Timeline | None]:
    """Record while inside; write `path` on the way out (nothing at all when path is None)."""
    if path is None:
        yield None
        return
    tl = Timeline()
    prev = activate(tl)
    try:
        yield tl
    finally:
        activate(prev)
        tl.save(path)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A saved trace, checked to be in the format `save` writes (used by tests and plots)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a trace (no traceEvents list)")
    return data


def track_names(trace: dict[str, Any]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
