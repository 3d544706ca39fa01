"""The engine's counters at one moment, and what happened between two moments.

    before = engine.counters()
    ...                                  # a generation, a benchmark's decode, a request
    spent = engine.counters() - before   # a Counters of the differences

Every field counts up from the engine's open (a subtraction is then what happened in
between); `t` is the moment (perf_counter seconds), so `spent.t` is the time between.
One snapshot for the generation's stats, the benchmarks and the distributed ranks'
report, instead of each picking counters off the actors.
"""

from __future__ import annotations

import msgspec


class Counters(msgspec.Struct, frozen=True, kw_only=True):
    t: float
    # The expert pool (actors/pool/slots.py).
    hits: int
    misses: int
    prefetch_used: int  # demanded experts a prefetch had already loaded
    prefetch_wasted: int  # prefetched experts evicted unused
    # The reads (actors/reader.py): counts, bytes, and where a read's time goes.
    reads: int
    failures: int
    landings: int  # reads installed where they landed, by a staging thread
    shelved: int  # predictions taken off the queue unread: their layer was routed without them
    shelved_dropped: int  # of those, evicted before anything read them (never read)
    bytes_read: int
    read_seconds: float
    queue_seconds: float
    pread_seconds: float
    finish_wait_seconds: float
    check_seconds: float
    stage_seconds: float
    # The disk meter (actors/disk_meter.py): time with a read in flight, its integral.
    disk_busy_seconds: float
    disk_in_flight_seconds: float
    # Compute waiting on reads (actors/router.py), split by what ended the wait.
    stall_seconds: float
    stall_late_seconds: float
    stall_unpredicted_seconds: float
    prefetch_hits_waited: int
    # Prefetch predictions scored against the true routing (actors/prefetch/scorer.py).
    predicted: int
    correct: int
    actual: int
    # Compute (actors/compute.py) and the decode batch (actors/decode_batch.py).
    mlx_seconds: float
    run_ahead_tokens: int
    run_ahead_misses: int
    ahead_steps: int  # decode steps queued second (actors/decode.py)
    awaited_tokens: int  # decode tokens queued whole, the GPU waiting for their reads
    awaited_layers: int  # ... their MoE layers answered
    awaited_host_seconds: float  # ... the host's time from a layer's publication to its answer
    awaited_gap_seconds: float  # ... from an answer to seeing the next layer published
    awaited_gpu_gap_seconds: float  # ... the GPU's part of it (its clock)
    awaited_tail_seconds: float  # ... the GPU's copies after an answer
    awaited_back_seconds: float  # ... from an answer to the host's first look at the next layer
    awaited_poll_seconds: float  # ... the last look that found it unpublished to the one that found it
    awaited_gpu_look_seconds: float  # the GPU's last look that found no answer to the one that did
    awaited_ready_layers: int  # layers every expert of which was in place when published
    batch_steps: int
    batch_rows_stepped: int

    def __sub__(self, earlier: Counters) -> Counters:
        return Counters(**{name: getattr(self, name) - getattr(earlier, name)
                           for name in self.__struct_fields__})

    @property
    def hit_rate(self) -> float:
        seen = self.hits + self.misses
        return self.hits / seen if seen else 0.0

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.actual if self.actual else 0.0

    @property
    def disk_busy_fraction(self) -> float:
        """Of a difference: the share of its time with at least one read in flight."""
        return self.disk_busy_seconds / max(self.t, 1e-12)

    @property
    def mean_in_flight(self) -> float:
        return self.disk_in_flight_seconds / max(self.t, 1e-12)
