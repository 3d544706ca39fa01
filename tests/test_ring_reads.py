"""The reader's io_uring path (`reader.io = "uring"`): the same bytes, order and errors as
the threads', through the real reader and engine over real containers (O_DIRECT and the
page cache), falling back to threads where it cannot run."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import trio
from helpers_engine import engine_config, forward_logits, generate, pool_is_clean

from actors.reader import ExpertReader
from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from qpack.reader import Container, PosixIO
from qpack.uring import Ring, supported


def _ring_works() -> bool:
    if not supported():
        return False
    try:
        Ring(2).close()
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _ring_works(), reason="io_uring unavailable here")
PROMPT = [40, 1079, 264, 8, 3, 7000, 512, 2, 99, 17]


@pytest.fixture
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)


@pytest.mark.parametrize("o_direct", [False, True])
async def test_the_ring_reads_every_expert_as_the_container_does(container, o_direct):
    with Container.open(container, verify="always", o_direct=o_direct) as c:
        reader = ExpertReader(c, concurrency=2, demand_lane=1, bulk_lane=2, io="uring", buffers=5)
        keys = [(layer, e) for layer in c.moe_layers for e in range(c.layer(layer).num_experts)]
        # Queued before the ring starts, so the order it takes them in is the queues'.
        loads = [reader.submit(key, demand=i % 3 == 0) for i, key in enumerate(keys)]
        reader.promote(loads[-2])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            with reader.bulk():
                # More reads than buffers: the ring takes more as buffers come back.
                order = []
                while len(order) < len(loads):
                    for load in loads:  # in the order they end: each buffer back at once
                        if load.done.is_set() and load.buffer is not None:
                            assert load.error is None, load.error
                            want = np.empty(c.manifest.max_stride, np.uint8)
                            c.read_expert(*load.key, want)
                            assert np.array_equal(load.buffer, want), load.key
                            reader.give_back(load.buffer)
                            load.buffer = None
                            order.append(load.key)
                    if len(order) < len(loads):
                        await reader.wait_any()
            nursery.cancel_scope.cancel()
    assert reader.io == "uring"
    # Taken demand first (the promoted one last among them), then the predictions in order.
    taken = [load.key for load in sorted(loads, key=lambda load: load.t_start)]
    demand = [*keys[::3], keys[-2]]
    assert taken == demand + [k for k in keys if k not in demand]
    s = reader.stats
    assert s.reads == len(keys) and s.failures == s.retries == 0 and s.check_seconds > 0
    assert s.demand_reads == len(keys[::3]) + 1


async def test_a_short_file_fails_as_with_threads_and_reads_again_first(container, tmp_path):
    """The ring's short read goes the threads' way: retried, then the same error."""
    import shutil

    broken = tmp_path / "broken.qpack"
    shutil.copytree(container, broken)
    with Container.open(broken, verify="off") as c:
        entry = c.layer(0)
        path = broken / entry.file
        os.truncate(path, entry.stride * (entry.num_experts - 1) + 100)  # the last blob cut
        errors = {}
        for io in ("threads", "uring"):
            reader = ExpertReader(c, concurrency=1, io=io, retries=1, retry_backoff_s=0.001)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader.run)
                good = reader.submit((0, 0), demand=True)
                bad = reader.submit((0, entry.num_experts - 1), demand=True)
                for load in (good, bad):
                    await load.done.wait()
                nursery.cancel_scope.cancel()
            assert good.error is None and bad.error is not None
            errors[io] = (str(bad.error), reader.stats.retries, reader.stats.failures)
    assert errors["uring"] == errors["threads"], errors
    assert "short read" in str(bad.error.__cause__)


async def test_reads_through_a_tools_io_stay_on_threads(container):
    class Counting(PosixIO):
        def __init__(self) -> None:
            self.reads = 0

        def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
            self.reads += 1
            return super().pread_into(fd, buf, offset)

    io = Counting()
    with Container.open(container, io=io) as c:
        reader = ExpertReader(c, concurrency=1, io="uring")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            load = reader.submit((0, 1), demand=True)
            await load.done.wait()
            nursery.cancel_scope.cancel()
    assert reader.io == "threads" and io.reads == 1 and load.error is None


@pytest.mark.parametrize("o_direct", [False, True])
async def test_the_engine_on_the_ring_gives_the_threads_logits_bit_for_bit(container, o_direct):
    """Smallest pool (every step misses), predictions two layers ahead, reads in flight
    when the generation ends: the same logits and tokens, and a clean pool after."""
    got = {}
    for io in ("threads", "uring"):
        cfg = engine_config(container, prefetch={"strategy": "lookahead", "depth": 2},
                            reader={"concurrency": 3, "o_direct": o_direct, "io": io})
        async with open_engine(cfg) as engine:
            done = await generate(engine, PROMPT, 10)
            pool_is_clean(engine)
            logits = await forward_logits(engine, PROMPT[:6], list(done.token_ids)[:4])
            got[io] = (list(done.token_ids), logits, engine._core.router.reader.io)
    assert got["uring"][2] == "uring"
    assert got["uring"][0] == got["threads"][0]
    for a, b in zip(got["uring"][1], got["threads"][1], strict=True):
        assert np.array_equal(a, b)


async def test_an_engine_on_the_ring_cancelled_mid_generation_closes_and_frees_its_reads(container):
    cfg = engine_config(container, prefetch={"strategy": "lookahead", "depth": 2},
                        reader={"concurrency": 3, "o_direct": True, "io": "uring"})
    with trio.fail_after(30):
        async with open_engine(cfg) as engine:
            reader = engine._core.router.reader
            with trio.move_on_after(0.05):
                async for _ in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=400)):
                    pass
            done = await generate(engine, PROMPT, 4)  # and it still serves
            assert len(done.token_ids) == 4
            pool_is_clean(engine)
            assert reader.io == "uring"
        assert reader.meter.in_flight == 0


async def test_a_layer_file_that_cannot_be_opened_fails_its_read_not_the_ring(container, tmp_path):
    """The ring opens a layer's file at its first read: an error there is that read's (the
    threads' retries, then its error), and the ring goes on with the others (it died, and
    every later read waited forever)."""
    import shutil

    root = tmp_path / "links.qpack"
    shutil.copytree(container, root, copy_function=os.link)  # hard links: no copy
    with Container.open(root, verify="off") as c:
        (root / "experts" / "layer_001.bin").unlink()  # gone after open, before any read of it
        reader = ExpertReader(c, concurrency=2, io="uring", retries=1, retry_backoff_s=0.001)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            bad = reader.submit((1, 0), demand=True)
            good = [reader.submit((0, e), demand=True) for e in range(4)]
            with trio.fail_after(10):
                for load in (bad, *good):
                    await load.done.wait()
            assert bad.error is not None and "layer 1" in str(bad.error)
            assert all(load.error is None for load in good)
            nursery.cancel_scope.cancel()


async def test_a_ring_that_fails_hands_its_reads_to_threads_and_loses_none(container):
    """The ring itself failing (here its descriptor swapped for one that is no ring: the
    kernel refuses `io_uring_enter` with EOPNOTSUPP) is no read's error: the reads it held
    are read again on disk threads, which serve every later read (before, its thread died
    and every read it held or was yet to take waited forever)."""
    with Container.open(container, verify="always") as c:
        reader = ExpertReader(c, concurrency=2, io="uring", buffers=3)
        keys = [(layer, e) for layer in c.moe_layers for e in range(c.layer(layer).num_experts)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            first = reader.submit(keys[0], demand=True)
            await first.done.wait()
            assert first.error is None and reader.io == "uring"
            reader.give_back(first.buffer)
            assert reader._ring is not None
            ring = reader._ring.ring
            real, ring.fd = ring.fd, os.open(os.devnull, os.O_RDONLY)
            try:
                # More reads than buffers: some are taken by the failing ring, the rest wait.
                loads = [reader.submit(key, demand=i % 2 == 0) for i, key in enumerate(keys[1:])]
                pending = set(range(len(loads)))
                with trio.fail_after(10):
                    while pending:  # each buffer back as soon as its read ends
                        for i in [i for i in pending if loads[i].done.is_set()]:
                            load = loads[i]
                            assert load.error is None, load.error
                            want = np.empty(c.manifest.max_stride, np.uint8)
                            c.read_expert(*load.key, want)
                            assert np.array_equal(load.buffer, want), load.key
                            reader.give_back(load.buffer)
                            pending.discard(i)
                        if pending:
                            await reader.wait_any()
                assert reader.io == "threads" and reader._ring is None
                again = reader.submit(keys[0], demand=True)
                with trio.fail_after(10):
                    await again.done.wait()
                assert again.error is None
            finally:
                os.close(real)
            nursery.cancel_scope.cancel()
    assert reader.meter.in_flight == 0
    assert reader.stats.failures == 0 and reader.stats.reads == len(keys) + 1
