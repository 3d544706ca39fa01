"""A pool larger than the memory that could hold it is refused with one line before MLX
allocates it: a failed MLX allocation segfaulted the process (rc 139)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from actors.pool.storage import PoolAllocationError, PoolStorage, slot_bytes
from pipeline.failures import one_line
from qpack.reader import Container


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def test_a_pool_past_available_memory_is_an_error_not_a_segfault(container: Path) -> None:
    fmt = Container.open(container, verify="off").manifest.layers[0].format
    slots = 4 * psutil.virtual_memory().available // slot_bytes(fmt)
    with pytest.raises(PoolAllocationError) as err:
        PoolStorage(fmt, slots)
    line = one_line(err.value)
    assert line.startswith("expert pool of ") and "cannot be allocated" in line, line
    small = PoolStorage(fmt, 4)  # the process is fine, and so is a pool that fits
    assert small.num_slots == 4
