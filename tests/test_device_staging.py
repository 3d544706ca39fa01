"""`device_staging`: an expert blob reaches MLX through `mx.load` of an npy view, byte-exact."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from actors.device_staging import NpyView, to_device


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
