"""Managed memory moved to the GPU in bulk: `cuMemPrefetchAsync` through the CUDA driver.

On MLX's CUDA backend an array made from host bytes (`mx.array(numpy)`) lives in managed
memory, and the first kernel that reads it pulls it across page fault by page fault
(~1 GB/s on the H200). A prefetch on a stream of the calling thread's own moves the
pages at copy-engine speed before any kernel runs, with no pageable bounce copy (MLX's
`Load`, `device_staging.to_device`) and without the GIL: ctypes releases it for the
driver calls. This is the `reader.device_copy = "prefetch"` path. Measured on the H200
(2026-12-02, benchmarks/managed_staging.py, 1.77 MiB blobs): 1.13 / 1.06 / 1.17 ms a blob
on 1 / 2 / 4 threads against MLX's Load at 2.11 / 1.07 / 0.67: the driver migrates one
range at a time, so it does not scale with threads, and "load" stays the default.

The driver calls go through `actors.cuda_driver`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from actors.cuda_driver import CudaDriverError, address, check, driver, on_cuda, stream
from actors.mx_typed import to_int

_CU_MEM_LOCATION_TYPE_DEVICE = 1


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def to_gpu(arrays: Sequence[mx.array]) -> None:
    """Every array's pages onto device 0, before this returns (one stream sync)."""
    cu, _ = driver()
    cu.cuMemPrefetchAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint,
                                         ctypes.c_void_p]
    s = stream()
    where = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, 0)
    for array in arrays:
        check(cu.cuMemPrefetchAsync_v2(address(array), array.nbytes, where, 0, s), "cuMemPrefetchAsync")
    check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")


def usable() -> bool:
    """Whether this process can prefetch: on MLX's CUDA backend, with the driver's API."""
    if not on_cuda():
        return False
    try:
        probe = mx.array(np.arange(64, dtype=np.uint8))
        to_gpu([probe])
        return to_int((probe.astype(mx.int32) + 1).sum()) == 2080
    except (CudaDriverError, AttributeError, ValueError, TypeError):
        return False
