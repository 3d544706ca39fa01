"""The CUDA driver API through ctypes: the context, a stream per thread, addresses.

The driver (libcuda, present wherever the NVIDIA driver is) rather than the runtime: MLX
links its CUDA runtime statically, so no shared libcudart is there to ask. MLX uses the
device's primary context; each thread makes it current before its first call. ctypes
releases the GIL for every call, so copies issued here never hold up the MLX thread's
Python or the event loop.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache

import mlx.core as mx
import numpy as np

_CU_STREAM_NON_BLOCKING = 1


class CudaDriverError(RuntimeError):
    """A driver call failed: the path that needed it is not usable here."""


@cache
def driver() -> tuple[ctypes.CDLL, ctypes.c_void_p]:
    """libcuda and the device's primary context (retained once per process)."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"no CUDA driver library: {exc}") from exc
    ctx = ctypes.c_void_p()
    check(cu.cuInit(0), "cuInit")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    return cu, ctx


def check(rc: int, what: str) -> None:
    if rc:
        raise CudaDriverError(f"{what}: CUresult {rc}")


_local = threading.local()


def current() -> ctypes.CDLL:
    """libcuda, with the primary context current on this thread (made so once)."""
    cu, ctx = driver()
    if not getattr(_local, "current", False):
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        _local.current = True
    return cu


def stream() -> ctypes.c_void_p:
    """This thread's stream (the primary context made current once)."""
    s = getattr(_local, "stream", None)
    if s is None:
        cu = current()
        s = ctypes.c_void_p()
        check(cu.cuStreamCreate(ctypes.byref(s), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        _local.stream = s
    return s


def address(array: mx.array) -> int:
    """The address of an evaluated array's memory (managed: the same for host and GPU)."""
    return int(np.frombuffer(memoryview(array), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]


def on_cuda() -> bool:
    """Whether MLX runs on its CUDA backend (False on the CPU backend and on Metal)."""
    try:
        return mx.default_device() != mx.cpu and bool(mx.cuda.is_available())
    except AttributeError:  # an MLX build without the `cuda` module
        return False


def gpu_memory_bytes() -> int:
    """The GPU's memory as MLX reports it (0 where it does not say)."""
    info = mx.device_info()
    return int(info.get("memory_size") or info.get("total_memory") or 0)
