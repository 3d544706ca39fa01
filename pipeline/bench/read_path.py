"""Where a cold case's decode time goes on the read path (`moestream bench`).

Two marks, at the first decode token and after the last, give for the decode window:
the disk's busy fraction (time with at least one read in flight / wall time), the mean
reads in flight, the bandwidth it delivered, the bytes prefetched in vain, compute's
wait on reads split into "predicted but late" and "not predicted", and a read's time
split into queueing, the pread, waiting for a staging thread, the crc32 and the copy
into device memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from actors.disk_meter import MeterSnapshot


class ReadPath(msgspec.Struct, kw_only=True):
    """The decode window's read path (zeros when nothing was read)."""

    disk_busy_fraction: float = 0.0
    mean_in_flight: float = 0.0
    disk_gb_s: float = 0.0  # bytes read / decode wall time
    wasted_mb: float = 0.0  # prefetched, evicted unused
    stall_late_s: float = 0.0
    stall_unpredicted_s: float = 0.0
    decode_s: float = 0.0
    # Per read, mean milliseconds.
    queue_ms: float = 0.0
    pread_ms: float = 0.0
    finish_wait_ms: float = 0.0
    check_ms: float = 0.0
    stage_ms: float = 0.0


@dataclasses.dataclass
class Mark:
    meter: MeterSnapshot
    reader: dict[str, Any]
    router: dict[str, Any]
    wasted: int


def mark(engine: Any) -> Mark:
    router = engine.router
    return Mark(router.reader.meter.snapshot(), dataclasses.asdict(router.reader.stats),
                dataclasses.asdict(router.stats), router.table.prefetch_wasted)


def between(start: Mark | None, end: Mark, stride: int) -> ReadPath:
    if start is None:
        return ReadPath()
    use = end.meter.since(start.meter)
    d = {k: end.reader[k] - start.reader[k] for k in end.reader}
    reads = max(d["reads"] + d["failures"], 1)

    def ms(key: str) -> float:
        return 1000.0 * d[key] / reads

    return ReadPath(
        disk_busy_fraction=use.busy_fraction, mean_in_flight=use.mean_in_flight,
        disk_gb_s=d["bytes_read"] / max(use.seconds, 1e-9) / 1e9,
        wasted_mb=(end.wasted - start.wasted) * stride / 1e6,
        stall_late_s=end.router["stall_late_seconds"] - start.router["stall_late_seconds"],
        stall_unpredicted_s=end.router["stall_unpredicted_seconds"]
        - start.router["stall_unpredicted_seconds"],
        decode_s=use.seconds, queue_ms=ms("queue_seconds"), pread_ms=ms("pread_seconds"),
        finish_wait_ms=ms("finish_wait_seconds"), check_ms=ms("check_seconds"),
        stage_ms=ms("stage_seconds"),
    )
