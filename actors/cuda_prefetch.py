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

The driver API (libcuda, present wherever the NVIDIA driver is) rather than the runtime:
MLX links its CUDA runtime statically, so no shared libcudart is there to ask. MLX uses
the device's primary context; each thread makes it current before its first call.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from functools import cache

import mlx.core as mx
import numpy as np

from actors.mx_typed import to_int

_CU_STREAM_NON_BLOCKING = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A driver call failed: the prefetch path is not usable here."""


@cache
def _driver() -> tuple[ctypes.CDLL, ctypes.c_void_p]:
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"no CUDA driver library: {exc}") from exc
    ctx = ctypes.c_void_p()
    _check(cu.cuInit(0), "cuInit")
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    cu.cuMemPrefetchAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint,
                                         ctypes.c_void_p]
    return cu, ctx


def _check(rc: int, what: str) -> None:
    if rc:
        raise CudaDriverError(f"{what}: CUresult {rc}")


_local = threading.local()


def _stream() -> ctypes.c_void_p:
    """This thread's stream (the primary context made current once)."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        cu, ctx = _driver()
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        stream = ctypes.c_void_p()
        _check(cu.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        _local.stream = stream
    return stream


def address(array: mx.array) -> int:
    """The host-visible address of an evaluated array in managed memory."""
    return int(np.frombuffer(memoryview(array), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]


def to_gpu(arrays: Sequence[mx.array]) -> None:
    """Every array's pages onto device 0, before this returns (one stream sync)."""
    cu, _ = _driver()
    stream = _stream()
    where = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, 0)
    for array in arrays:
        _check(cu.cuMemPrefetchAsync_v2(address(array), array.nbytes, where, 0, stream),
               "cuMemPrefetchAsync")
    _check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")


def usable() -> bool:
    """Whether this process can prefetch: on MLX's CUDA backend, with the driver's API."""
    if mx.default_device() == mx.cpu or not mx.cuda.is_available():
        return False
    try:
        probe = mx.array(np.arange(64, dtype=np.uint8))
        to_gpu([probe])
        return to_int((probe.astype(mx.int32) + 1).sum()) == 2080
    except (CudaDriverError, AttributeError, ValueError, TypeError):
        return False
