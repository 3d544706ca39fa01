"""`device_staging`: an expert blob reaches MLX through `mx.load` of an npy view, byte-exact,
on the readers' long-lived staging threads."""

from __future__ import annotations

import io
import threading

import mlx.core as mx
import numpy as np
import pytest
import trio

from actors.device_staging import NpyView, to_device
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
    def stage(buffer: np.ndarray) -> tuple[str, mx.array]:
        return threading.current_thread().name, to_device(buffer[:nbytes])

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
