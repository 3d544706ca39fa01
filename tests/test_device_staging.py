"""`device_staging`: an expert blob reaches MLX through `mx.load` of an npy view, byte-exact,
on the readers' long-lived staging threads."""

from __future__ import annotations

import io
import threading

import mlx.core as mx
import numpy as np
import pytest
import trio

from actors.device_staging import NpyView, to_device, to_device_many
from actors.reader import ExpertReader
from qpack.reader import Container


@pytest.mark.parametrize("nbytes", [1, 127, 128, 129, 4096, 1_769_472])
def test_to_device_round_trips_every_byte(nbytes):
    blob = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    out = to_device(blob)
    assert out.dtype == mx.uint8 and out.shape == (nbytes,)
    assert np.array_equal(np.array(out), blob)


def test_a_view_of_a_larger_staging_buffer_reads_only_the_view():
    buffer = np.arange(4096, dtype=np.uint8)
    assert np.array_equal(np.array(to_device(buffer[:1000])), buffer[:1000])


def test_many_blobs_go_through_one_load_and_come_back_each_whole():
    rng = np.random.default_rng(7)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 1000, 65_537, 300_000, 7)]
    out = to_device_many(blobs)
    assert [o.shape for o in out] == [(b.nbytes,) for b in blobs]
    for got, blob in zip(out, blobs, strict=True):
        assert np.array_equal(np.array(got), blob)
    view = NpyView(*blobs)
    whole = bytearray(view.seek(0, io.SEEK_END))
    view.seek(0)
    assert view.readinto(whole) == len(whole)
    assert np.array_equal(np.load(io.BytesIO(bytes(whole))), np.concatenate(blobs))


def test_reads_that_straddle_the_header_see_one_continuous_file():
    blob = np.arange(300, dtype=np.uint16).view(np.uint8)
    view = NpyView(blob)
    whole = bytearray(view.seek(0, io.SEEK_END))
    view.seek(0)
    got = 0
    while got < len(whole):  # odd-sized chunks cross the header/blob boundary
        got += view.readinto(memoryview(whole)[got : got + 37])
    header_len = len(whole) - blob.nbytes
    assert whole.startswith(b"\x93NUMPY") and header_len % 64 == 0
    assert bytes(whole[header_len:]) == blob.tobytes()
    assert np.array_equal(np.load(io.BytesIO(bytes(whole))), blob)
    assert view.readinto(bytearray(8)) == 0  # past the end: nothing, as a file would


@pytest.fixture
def container(synth_checkpoint, packed):
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)


async def test_readers_stage_on_fixed_threads_that_outlive_them(container):
    """Threads that touch MLX get streams that are never freed: staging must not run on
    trio's worker threads (they come and go), only on the same few threads every time."""
    def stage(buffers: list[np.ndarray]) -> list[tuple[str, mx.array]]:
        name = threading.current_thread().name
        return [(name, blob) for blob in to_device_many([b[:nbytes] for b in buffers])]

    seen: set[str] = set()
    with Container.open(container, verify="off") as c:
        nbytes = c.manifest.layer(0).format.nbytes
        for _ in range(2):  # a second reader, as a second engine would, reuses the threads
            reader = ExpertReader(c, concurrency=3, stage=stage)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader.run)
                loads = [reader.submit((0, e), demand=e % 2 == 0) for e in range(12)]
                for load in loads:
                    await load.done.wait()
                    assert load.error is None
                    name, blob = load.staged
                    seen.add(name)
                    want = np.empty(c.manifest.max_stride, dtype=np.uint8)
                    c.read_expert(*load.key, want)
                    assert np.array_equal(np.array(blob), want[:nbytes])
                    reader.give_back(load.buffer)
                nursery.cancel_scope.cancel()
    assert seen and seen <= {f"moestream-stage-{i}" for i in range(3)}


async def test_reads_finished_while_a_stager_is_busy_are_staged_together(container):
    """A staging thread takes every read queued for it at once: one copy for the batch,
    each load still gets its own blob, byte for byte."""
    batches: list[int] = []
    release = threading.Event()

    def stage(buffers: list[np.ndarray]) -> list[mx.array]:
        if not batches:
            release.wait(10)  # hold the first batch until the other reads are queued
        batches.append(len(buffers))
        return to_device_many([b[:nbytes] for b in buffers])

    with Container.open(container, verify="off") as c:
        nbytes = c.manifest.layer(0).format.nbytes
        reader = ExpertReader(c, concurrency=1, stage=stage)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            loads = [reader.submit((0, e), demand=True) for e in range(8)]
            with trio.fail_after(10):
                while not all(load.t_read for load in loads[1:]):
                    await trio.sleep(0.005)
            await trio.sleep(0.05)  # the last read's hand-over to the stager
            release.set()
            for load in loads:
                await load.done.wait()
                assert load.error is None
                want = np.empty(c.manifest.max_stride, dtype=np.uint8)
                c.read_expert(*load.key, want)
                assert np.array_equal(np.array(load.staged), want[:nbytes])
                reader.give_back(load.buffer)
            nursery.cancel_scope.cancel()
    assert max(batches) > 1 and sum(batches) == 8
