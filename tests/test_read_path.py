"""The read path's orderings and measurements: demand reads before queued prefetches,
promotion, the disk meter's busy fraction, the queue-depth probe, the GIL's switch
interval while reading; through the real reader over a real container (only the disk's
timing is held back, through the `ExpertIO` seam)."""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from actors.disk_meter import DiskMeter
from actors.queue_depth import DECODE_MAX_DEPTH, MIN_DEPTH, choose_depth
from actors.reader import ExpertReader
from actors.switch_interval import SWITCH_INTERVAL_S
from qpack.reader import Container, PosixIO


@pytest.fixture
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)


class GatedIO(PosixIO):
    """Real preads; the first one waits for `release`, so loads queue up behind it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.order: list[int] = []  # offsets, in the order the disk was asked for them
        self._lock = threading.Lock()

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        with self._lock:
            first = not self.order
            self.order.append(offset)
        if first:
            self.release.wait(10)
        return super().pread_into(fd, buf, offset)


async def test_demand_reads_start_before_queued_prefetches_and_promotion_jumps_the_line(container):
    io = GatedIO()
    with Container.open(container, io=io) as c:
        stride = c.layer(0).stride
        reader = ExpertReader(c, concurrency=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            first = reader.submit((0, 0), demand=False)
            while not first.started:  # the one disk thread is now held in its pread
                await trio.sleep(0.001)
            prefetches = [reader.submit((0, e), demand=False) for e in (1, 2, 3, 4)]
            demand = reader.submit((0, 5), demand=True)
            reader.promote(prefetches[2])  # expert 3: needed now, so next after the demand
            io.release.set()
            for load in [first, *prefetches, demand]:
                await load.done.wait()
                assert load.error is None, load.error
                reader.give_back(load.buffer)
            nursery.cancel_scope.cancel()
    assert [offset // stride for offset in io.order] == [0, 5, 3, 1, 2, 4]
    assert prefetches[2].predicted and prefetches[2].demand and not demand.predicted
    # Every read's time is split: waiting for a thread, the pread, the rest.
    s = reader.stats
    assert s.reads == 6 and s.demand_reads == 2 and s.prefetch_reads == 4
    assert s.queue_seconds > 0 and s.pread_seconds > 0
    assert s.read_seconds >= s.pread_seconds


async def test_checksums_run_off_the_disk_threads_and_a_blob_is_right(container):
    with Container.open(container, verify="always") as c:
        reader = ExpertReader(c, concurrency=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            loads = [reader.submit((1, e), demand=True) for e in range(6)]
            for load in loads:
                await load.done.wait()
                want = np.empty(c.manifest.max_stride, np.uint8)
                c.read_expert(*load.key, want)
                assert np.array_equal(load.buffer, want)
                reader.give_back(load.buffer)
            nursery.cancel_scope.cancel()
    assert reader.stats.check_seconds > 0 and reader.stats.failures == 0


def test_disk_meter_integrates_reads_in_flight_over_time():
    now = [0.0]
    meter = DiskMeter(clock=lambda: now[0])
    start = meter.snapshot()
    meter.begin()  # t=0: one read
    now[0] = 1.0
    meter.begin()  # t=1: two
    now[0] = 2.0
    meter.end()  # t=2: one
    now[0] = 3.0
    meter.end()  # t=3: none (idle until t=4)
    now[0] = 4.0
    use = meter.snapshot().since(start)
    assert use.seconds == 4.0 and use.reads == 2
    assert use.busy_fraction == pytest.approx(3 / 4)
    assert use.mean_in_flight == pytest.approx((1 + 2 + 1) / 4)


def test_queue_depth_probe_picks_a_bounded_depth_once_per_container(container):
    with Container.open(container, verify="off") as c:
        probe = choose_depth(c)
        assert MIN_DEPTH <= probe.depth <= DECODE_MAX_DEPTH
        assert 1 in probe.gb_s and all(v > 0 for v in probe.gb_s.values())
        assert probe.gb_s[probe.best] == max(probe.gb_s.values())
        assert choose_depth(c) is probe  # measured once per process
        # The prefill's bulk lane: up to the best depth with "auto", none with a count.
        from pipeline.config.loading import config_from_dict
        from pipeline.engine_parts import MAX_BULK_DEPTH, reader_bulk_lane

        def bulk(concurrency: object) -> int:
            config = config_from_dict({"model": {"path": str(container)}, "reader": {"concurrency": concurrency}})
            return reader_bulk_lane(config, c, probe.depth)

        assert bulk("auto") == max(0, min(probe.best, MAX_BULK_DEPTH) - probe.depth)
        assert bulk(2) == 0


async def test_the_gil_switch_interval_is_short_while_reading_and_restored(container):
    before = sys.getswitchinterval()
    with Container.open(container, verify="off") as c:
        readers = [ExpertReader(c, concurrency=1), ExpertReader(c, concurrency=1)]
        async with trio.open_nursery() as nursery:
            for reader in readers:
                nursery.start_soon(reader.run)
            await trio.sleep(0.01)
            assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S), abs=2e-6)
            nursery.cancel_scope.cancel()
    assert sys.getswitchinterval() == before


class HeldIO(PosixIO):
    """Real preads; a read whose offset is in `held` waits for `release` first."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.held: set[int] = set()
        self.started: list[int] = []
        self._lock = threading.Lock()

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        with self._lock:
            self.started.append(offset)
        if offset in self.held:
            self.release.wait(10)
        return super().pread_into(fd, buf, offset)


@pytest.mark.parametrize("lane", [1, 0])
async def test_a_demand_read_starts_at_once_in_its_lane_while_predictions_hold_every_thread(container, lane):
    """Two disk threads busy with predictions: with a demand lane the demand read is
    served now; without one it waits until a prediction's read ends."""
    io = HeldIO()
    with Container.open(container, verify="off", io=io) as c:
        stride = c.manifest.layer(0).stride
        io.held = {0, stride}  # experts 0 and 1 of layer 0
        reader = ExpertReader(c, concurrency=2, demand_lane=lane)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            predicted = [reader.submit((0, e), demand=False) for e in (0, 1)]
            with trio.fail_after(10):
                while len(io.started) < 2:
                    await trio.sleep(0.002)
            demand = reader.submit((0, 5), demand=True)
            if lane:
                with trio.fail_after(10):  # served while both predictions are still held
                    await demand.done.wait()
            else:
                await trio.sleep(0.3)
            served_first = demand.done.is_set() and not any(p.done.is_set() for p in predicted)
            io.release.set()
            for load in (*predicted, demand):
                await load.done.wait()
                assert load.error is None
            nursery.cancel_scope.cancel()
    assert served_first == bool(lane)


async def test_the_bulk_lane_reads_only_while_a_prompt_is_read(container):
    """One queue thread and a bulk lane of two: four held predictions keep one read in
    flight until `bulk`, then three; once it is left the lane takes nothing new."""
    io = HeldIO()
    with Container.open(container, verify="off", io=io) as c:
        stride = c.manifest.layer(0).stride
        io.held = {e * stride for e in range(4)}
        reader = ExpertReader(c, concurrency=1, bulk_lane=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            loads = [reader.submit((0, e), demand=False) for e in range(4)]
            with trio.fail_after(10):
                while not io.started:
                    await trio.sleep(0.002)
            await trio.sleep(0.2)
            alone = len(io.started)
            with reader.bulk(), trio.fail_after(10):
                while len(io.started) < 3:
                    await trio.sleep(0.002)
            later = [reader.submit((0, e), demand=False) for e in (6, 7)]
            io.release.set()
            for load in (*loads, *later):
                await load.done.wait()
                assert load.error is None
                reader.give_back(load.buffer)
            nursery.cancel_scope.cancel()
    assert alone == 1
    assert sorted(io.started[:3]) == [0, stride, 2 * stride]


@pytest.mark.parametrize("yields", [True, False])
async def test_predictions_wait_while_a_demand_read_runs_when_they_yield(container, yields):
    io = HeldIO()
    with Container.open(container, verify="off", io=io) as c:
        io.held = {0}  # the demand: expert 0 of layer 0
        reader = ExpertReader(c, concurrency=2, prefetch_yields=yields)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            demand = reader.submit((0, 0), demand=True)
            with trio.fail_after(10):
                while not io.started:
                    await trio.sleep(0.002)
            predicted = [reader.submit((0, e), demand=False) for e in (3, 4)]
            await trio.sleep(0.2)
            started_beside = len(io.started) - 1
            io.release.set()
            for load in (demand, *predicted):
                await load.done.wait()
                assert load.error is None
            nursery.cancel_scope.cancel()
    assert started_beside == (0 if yields else 2)


@pytest.mark.parametrize("end", ["drain", "settle"])
async def test_more_queued_predictions_than_staging_buffers_still_drain_and_settle(container, end):
    """A failed step drains, an idle engine settles: with more loads out than staging
    buffers, each landed load must give its buffer back for the queued ones to start."""
    from actors.pool.eviction import LRU
    from actors.pool.slots import SlotTable
    from actors.router import ExpertRouter

    installed: list[int] = []

    async def install(items):  # the engine's installer copies blobs into the pool
        installed.extend(slot for slot, _blob in items)

    with Container.open(container) as c:
        reader = ExpertReader(c, concurrency=1, buffers=2)
        router = ExpertRouter(SlotTable(16, LRU()), reader, c.manifest.num_experts, install)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            nursery.start_soon(router.run)
            await router.prefetch([(0, list(range(8)))], tick=1)
            with trio.fail_after(20):
                await (router.drain() if end == "drain" else router.settle())
            assert not router.loads and len(reader.queue.free) == 2
            nursery.cancel_scope.cancel()
    assert reader.stats.reads == 8
    assert len(installed) == (8 if end == "settle" else 0)


class SecondHeld(PosixIO):
    """Real preads; the second one waits for `release`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._count = 0
        self._lock = threading.Lock()

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        with self._lock:
            self._count += 1
            second = self._count == 2
        if second:
            self.release.wait(10)
        return super().pread_into(fd, buf, offset)


async def test_settle_collects_a_read_that_ends_during_an_install(container):
    """A read that ends while the router awaits an install (on a GPU the direct path's
    install awaits the MLX thread) is collected at once: the settle does not sleep until
    its timeout waiting for a read that has already ended (session 22: 2 s at the end of
    every generation)."""
    from actors.pool.eviction import LRU
    from actors.pool.slots import SlotTable
    from actors.router import ExpertRouter

    io, installs = SecondHeld(), []

    async def install(items):
        installs.append(len(items))
        if len(installs) == 1:  # the second read ends while this install is under way
            io.release.set()
            while not all(load.done.is_set() for load in router.loads.values()):
                await trio.sleep(0.001)

    with Container.open(container, io=io) as c:
        reader = ExpertReader(c, concurrency=1)
        router = ExpertRouter(SlotTable(16, LRU()), reader, c.manifest.num_experts, install)
        router.settle_timeout_s = 30.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            nursery.start_soon(router.run)
            await router.prefetch([(0, [0, 1])], tick=1)
            with trio.fail_after(5):
                await router.settle()
            assert not router.loads and installs == [1, 1]
            nursery.cancel_scope.cancel()


def test_landing_follows_the_setting_and_auto_lands(container):
    """`reader.land`: on and off as set; auto lands, whatever the disk and reader count."""
    from pipeline.config.loading import config_from_dict
    from pipeline.engine_parts import landing_wanted

    def wanted(**reader: object) -> bool:
        return landing_wanted(config_from_dict({"model": {"path": str(container)}, "reader": reader}))

    assert wanted(land="on", concurrency="auto") and not wanted(land="off", concurrency=2)
    assert wanted(land="auto", concurrency=2) and wanted(land="auto", concurrency="auto")


@asynccontextmanager
async def _shelving(container: Path, slots: int, predicted: list[int]) -> AsyncIterator[Any]:
    """A router and one reader over a gated disk, `predicted` experts of layer 0 ordered
    and the first of them held in its pread; then layer 0 is routed to `predicted[0]`
    (and `predicted[1]` with more than 4 slots) and the stale rest are shelved. Yields
    (router, reader, io, stride, nursery); the disk is released by the test."""
    from actors.pool.eviction import LRU
    from actors.pool.slots import SlotTable
    from actors.router import ExpertRouter

    async def install(items):
        pass

    io = GatedIO()
    with Container.open(container, io=io) as c:
        reader = ExpertReader(c, concurrency=1)
        router = ExpertRouter(SlotTable(slots, LRU()), reader, c.manifest.num_experts, install)
        chosen = predicted[:2] if slots > 4 else predicted[:1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            nursery.start_soon(router.run)
            with trio.fail_after(10):
                await router.prefetch([(0, predicted)], tick=1)
                while not (router.loads and router.loads[(0, predicted[0])].started):
                    await trio.sleep(0.001)  # held in its pread
                nursery.start_soon(router.demand, 0, chosen, 2)
                while reader.stats.shelved < len(predicted) - len(chosen):
                    await trio.sleep(0.001)
                yield router, reader, io, c.layer(0).stride, nursery
            nursery.cancel_scope.cancel()


async def test_a_layer_routed_without_its_queued_predictions_shelves_them_until_wanted(container):
    """Stale predictions (actors/router.py): once layer 0 is routed to experts 0 and 1,
    the queued reads predicted for 2-5 leave the queue unread, keeping their slots (the
    table, and so `replay`, as without shelving); a shelved key read again when it is
    demanded or predicted again, and the rest when the engine settles."""
    async with _shelving(container, 16, [0, 1, 2, 3, 4, 5]) as (router, reader, io, stride, _):
        assert sorted(k for k, load in router.loads.items() if load.shelved) == [
            (0, 2), (0, 3), (0, 4), (0, 5)]
        io.release.set()
        while reader.stats.reads < 2:
            await trio.sleep(0.001)
        assert [offset // stride for offset in io.order] == [0, 1]
        assert all(router.table.state((0, e)) == "loading" for e in (2, 3, 4, 5))
        await router.prefetch([(0, [3])], tick=3)  # predicted again: queued again
        await router.demand(0, [2, 3], 4)  # 2 demanded from the shelf
        assert sorted(offset // stride for offset in io.order) == [0, 1, 2, 3]
        await router.settle()  # the rest are read: an idle engine holds no shelf
        assert sorted(offset // stride for offset in io.order) == [0, 1, 2, 3, 4, 5]
        assert not router.loads and router.shelf.count == 0
        assert all(router.table.state((0, e)) == "ready" for e in range(6))
    assert reader.stats.reads == 6 and reader.stats.shelved == 4


async def test_a_shelved_prediction_evicted_before_it_is_wanted_is_never_read(container):
    """The pool needs the slots of shelved keys for another layer: they go with the
    eviction, unread, counted as dropped (the bench's "in vain" counts only reads)."""
    async with _shelving(container, 4, [0, 1, 2, 3]) as (router, reader, io, stride, _):
        io.release.set()
        await router.demand(1, [0, 1, 2], 3)  # three slots: the shelved keys' own
        await router.settle()
    read = [offset // stride for offset in io.order]
    assert read[0] == 0 and len(read) == 4  # (0, 0), then layer 1's three
    assert router.stats.shelved_dropped == 3 and not router.loads and router.shelf.count == 0
    assert sorted(router.table.resident()) == [(0, 0), (1, 0), (1, 1), (1, 2)]
