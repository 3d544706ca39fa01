"""Expert blobs straight from the reader's staging buffers into the pool's rows, by DMA.

The "load" path (`device_staging`) copies every blob twice on the host (into MLX's own
buffer through a Python `readinto`, then a pageable `cudaMemcpy` through the driver's
bounce buffer) and then scatters it into the pool with MLX: 1.2-2.5 ms a 1.77 MiB blob
inside the engine on the H200, which capped the read path at ~1-1.6 GB/s on a disk that
gives 10 (the page cache standing in for a Mac's SSD; docs/results.md, sessions 9-12).

Here the staging buffers are page-locked once (`cuMemHostRegister`), the disk threads'
`preadv` land in them, and an install is one `cuMemcpyHtoDAsync` per expert tensor from
the staging buffer into its slot row of the pool's arrays (whose memory MLX allocated and
never moves: the pool updates nothing through MLX on this path), then one stream sync.
No host copy, no bounce buffer, no MLX graph, no GIL held while bytes move.

Ordering with MLX. The copies write slots whose key is loading, so no forward pass reads
them for that key; but the slot's previous key may still be read by work MLX has queued
(the pipelined decoder queues step t+1 before step t's bookkeeping installs). So the
install first waits for the MLX thread's stream (`mx.synchronize`, run on that thread),
then copies on a stream of its own and waits for it: every kernel queued afterwards sees
the new bytes, every kernel queued before has finished with the old ones. In the
layer-by-layer path the GPU is idle at a demand anyway (the routing sync), so the wait
costs nothing there.

CUDA only; `probe` writes a pattern into one slot row of every array and reads it back
through an MLX kernel before the engine uses it, else the engine keeps "load".
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Mapping, Sequence
from functools import cache

import mlx.core as mx
import numpy as np

from actors.cuda_driver import CudaDriverError, address, check, current, driver, on_cuda, stream
from actors.mx_typed import to_int

# Portable, and mapped into the device's address space: a kernel may read it at its host
# address (a token waiting on the GPU pulls its installs from it: actors/device_wait.py).
_CU_MEMHOSTREGISTER_PORTABLE_DEVICEMAP = 1 | 2

Copy = tuple[int, int, int]  # (device address, host address, bytes)


@cache
def _typed() -> ctypes.CDLL:
    cu, _ = driver()
    cu.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    return cu


def pin(buffer: np.ndarray) -> bool:
    """Page-lock `buffer` for the rest of its life (copies from it then run at the copy
    engine's speed, asynchronously); False where the driver refuses (copies still work,
    through the driver's bounce buffer)."""
    cu = _typed()
    current()  # registration needs a context, not a stream
    ptr = buffer.ctypes.data
    if cu.cuMemHostRegister_v2(ptr, buffer.nbytes, _CU_MEMHOSTREGISTER_PORTABLE_DEVICEMAP):
        return False
    # Unregistered when the array goes, before numpy frees the memory under it.
    weakref.finalize(buffer, cu.cuMemHostUnregister, ptr)
    return True


class DirectWriter:
    """Writes byte ranges into the pool's arrays (name -> MLX array, evaluated, never
    replaced while the writer is in use)."""

    def __init__(self, arrays: Mapping[str, mx.array]) -> None:
        self.base = {name: address(array) for name, array in arrays.items()}
        self.arrays = dict(arrays)  # the memory must outlive every address taken from it
        self._cu = _typed()

    def write(self, copies: Sequence[Copy]) -> None:
        """On the MLX thread: wait for its queued work, then every copy, then their end."""
        mx.synchronize()
        self.write_now(copies)

    def write_now(self, copies: Sequence[Copy]) -> None:
        """On any thread, without waiting for MLX: every copy on this thread's stream, then
        their end. Only for rows no queued kernel reads (a landing: actors/router.py)."""
        cu, s = self._cu, stream()
        for dst, src, n in copies:
            check(cu.cuMemcpyHtoDAsync_v2(dst, src, n, s), "cuMemcpyHtoDAsync")
        check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")


def _last_row_sum(array: mx.array) -> int:
    # Taken from the whole array each time, by a gather as the forward's reads are: an
    # evaluated slice kept from before the write may hold a copy of the old bytes.
    row = mx.take(array, mx.array([array.shape[0] - 1]), axis=0)
    return to_int(row.reshape(-1).view(mx.uint8).astype(mx.int64).sum())


def probe(arrays: Mapping[str, mx.array]) -> DirectWriter | None:
    """A writer for these arrays if a DMA into them is seen by MLX's kernels here (on the
    MLX thread, before any install); None elsewhere. The probed row is zeroed again."""
    if not on_cuda():
        return None
    try:
        writer = DirectWriter(arrays)
        for name, array in arrays.items():
            n = array.nbytes // array.shape[0]
            pattern = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            pin(pattern)
            last = writer.base[name] + (array.shape[0] - 1) * n
            writer.write([(last, pattern.ctypes.data, n)])
            seen = _last_row_sum(array)
            zeros = np.zeros(n, dtype=np.uint8)  # held: the copy reads it after this line
            writer.write([(last, zeros.ctypes.data, n)])
            if seen != int(pattern.astype(np.int64).sum()) or _last_row_sum(array) != 0:
                return None
        return writer
    except (CudaDriverError, AttributeError, ValueError, TypeError, RuntimeError):
        return None
