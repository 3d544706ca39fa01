"""Where a cold case's decode time goes on the read path (`moestream bench`).

Two snapshots of the engine's counters (`Engine.counters`), at the first decode token
and after the last, give for the decode window: the disk's busy fraction (time with at
least one read in flight / wall time), the mean
reads in flight, the bandwidth it delivered, the bytes prefetched in vain (and the
predictions shelved before they were read: actors/router.py), compute's
wait on reads split into "predicted but late" and "not predicted", and a read's time
split into queueing, the pread, waiting for a staging thread, the crc32 and the copy
into device memory.
"""

from __future__ import annotations

import msgspec

from pipeline.counters import Counters


class ReadPath(msgspec.Struct, kw_only=True):
    """The decode window's read path (zeros when nothing was read)."""

    disk_busy_fraction: float = 0.0
    mean_in_flight: float = 0.0
    disk_gb_s: float = 0.0  # bytes read / decode wall time
    wasted_mb: float = 0.0  # prefetched, read, evicted unused
    shelved_mb: float = 0.0  # predictions taken off the queue unread (actors/router.py)
    stall_late_s: float = 0.0
    stall_unpredicted_s: float = 0.0
    decode_s: float = 0.0
    # Compute's calls on the MLX thread (graph building, kernels, the syncs): with the
    # stall, what a decode's time is besides the host's own work between them.
    mlx_s: float = 0.0
    # Per read, mean milliseconds.
    queue_ms: float = 0.0
    pread_ms: float = 0.0
    finish_wait_ms: float = 0.0
    check_ms: float = 0.0
    stage_ms: float = 0.0
    landed_fraction: float = 0.0  # of the reads, installed where they landed (reader.land)
    # Decode tokens queued whole, the GPU waiting for their reads (compute.device_wait),
    # and the host's mean time from a layer's publication to its answer (the GPU waits it).
    waited_tokens: int = 0
    answer_ms: float = 0.0
    gap_ms: float = 0.0  # from an answer to the next layer seen published (GPU work + polling)
    gpu_gap_ms: float = 0.0  # ... the GPU's own part: a wait's end to the next one's publication
    tail_ms: float = 0.0  # the GPU's copies after an answer (answer seen to the wait's end)
    back_ms: float = 0.0  # ... the host's: an answer to its first look at the next layer
    poll_ms: float = 0.0  # ... the last look that found it unpublished to the one that found it
    gpu_look_ms: float = 0.0  # the GPU's last look that found no answer to the one that did
    # Of the waited layers, those every expert of which was in place when published.
    ready_fraction: float = 0.0
    # CPU seconds per kind of thread over the same window (pipeline/bench/thread_cpu.py):
    # which of the host's threads is busy when the disk is not.
    thread_cpu_s: dict[str, float] = msgspec.field(default_factory=dict)


def between(start: Counters | None, end: Counters, stride: int) -> ReadPath:
    """The read path from the engine's counters at the first decode token to the end."""
    if start is None:
        return ReadPath()
    d = end - start
    reads = max(d.reads + d.failures, 1)
    layers = max(d.awaited_layers, 1)
    gaps = max(d.awaited_layers - d.awaited_tokens, 1)  # a waited token's first layer has none

    def ms(seconds: float) -> float:
        return 1000.0 * seconds / reads

    return ReadPath(
        disk_busy_fraction=d.disk_busy_fraction, mean_in_flight=d.mean_in_flight,
        disk_gb_s=d.bytes_read / max(d.t, 1e-9) / 1e9,
        wasted_mb=(d.prefetch_wasted - d.shelved_dropped) * stride / 1e6,
        shelved_mb=d.shelved * stride / 1e6,
        stall_late_s=d.stall_late_seconds, stall_unpredicted_s=d.stall_unpredicted_seconds,
        decode_s=d.t, mlx_s=d.mlx_seconds, queue_ms=ms(d.queue_seconds), pread_ms=ms(d.pread_seconds),
        finish_wait_ms=ms(d.finish_wait_seconds), check_ms=ms(d.check_seconds),
        stage_ms=ms(d.stage_seconds), landed_fraction=d.landings / reads,
        waited_tokens=d.awaited_tokens,
        answer_ms=1000.0 * d.awaited_host_seconds / layers,
        gap_ms=1000.0 * d.awaited_gap_seconds / gaps,
        gpu_gap_ms=1000.0 * d.awaited_gpu_gap_seconds / gaps,
        tail_ms=1000.0 * d.awaited_tail_seconds / layers,
        back_ms=1000.0 * d.awaited_back_seconds / gaps,
        poll_ms=1000.0 * d.awaited_poll_seconds / gaps,
        gpu_look_ms=1000.0 * d.awaited_gpu_look_seconds / layers,
        ready_fraction=d.awaited_ready_layers / layers,
    )
