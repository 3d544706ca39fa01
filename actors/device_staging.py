"""Expert blobs into GPU memory at copy-engine speed.

On MLX's CUDA backend an array made from host memory (`mx.array(numpy)`) lives in
managed (unified) memory: the CPU fills it, and the first kernel that reads it pulls
it across page fault by page fault, ~1 GB/s on the H200, slower than the disk. MLX's
`Load` primitive instead allocates device memory and issues one `cudaMemcpyAsync`.
`NpyView` lets `mx.load` read a blob that is already in a staging buffer: it presents
the buffer as a `.npy` file (a 128-byte header, then the blob's bytes, never copied
here), so the only copies are MLX's own host buffer and the DMA.

`mx.load` on a Python file object evaluates at once, in the calling thread, on that
thread's stream: a reader's staging thread (`MlxWorker.staging`) pays for the copy, the
MLX thread does not.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Sequence
from typing import Any, BinaryIO, cast

import mlx.core as mx
import numpy as np
from numpy.lib import format as npy_format


def _npy_header(nbytes: int) -> bytes:
    out = io.BytesIO()
    npy_format.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False, "shape": (nbytes,)})
    return out.getvalue()


class NpyView:
    """A read-only file object over (`.npy` header, blobs...); what `mx.load` needs of one.

    Several blobs are presented as one: a batch of finished reads costs one `mx.load`
    (one host buffer, one DMA), where each load pays MLX's Python callbacks (each takes
    the GIL, which the MLX thread and the event loop hold most of the time)."""

    closed = False

    def __init__(self, *blobs: np.ndarray) -> None:
        views = [memoryview(blob).cast("B") for blob in blobs]
        self._head = _npy_header(sum(len(v) for v in views))
        self._parts: list[tuple[int, memoryview]] = []
        start = 0
        for part in (memoryview(self._head), *views):
            self._parts.append((start, part))
            start += len(part)
        self._size = start
        self._pos = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        for start, part in self._parts:
            lo = self._pos + done - start
            if done == len(out) or lo >= len(part) or lo < 0:
                continue
            n = min(len(out) - done, len(part) - lo)
            if n >= _GIL_FREE_BYTES and not out.readonly:
                _copy_without_gil(out[done : done + n], part[lo : lo + n])
            else:
                out[done : done + n] = part[lo : lo + n]
            done += n
        self._pos += done
        return done


# A slice assignment copies under the GIL: 1.7 MiB at a time, it kept the event loop and
# the MLX thread waiting (a busy Python loop beside such copies ran at 55 % of its speed
# on the 2-core VM, 2026-12-01). ctypes' memmove releases the GIL while it copies.
_GIL_FREE_BYTES = 64 * 1024


def _copy_without_gil(dst: memoryview, src: memoryview) -> None:
    target = (ctypes.c_char * len(dst)).from_buffer(dst)
    ctypes.memmove(target, np.frombuffer(src, dtype=np.uint8).ctypes.data, len(src))


def _load(view: NpyView) -> mx.array:
    # `mx.load` reads any object with read / seek / tell, and a .npy holds one array; MLX's
    # stub says a BinaryIO, and the union of every format's result.
    return cast(mx.array, mx.load(cast(BinaryIO, view), format="npy"))


def to_device(blob: np.ndarray) -> mx.array:
    """The blob's bytes as a uint8 MLX array in device memory (see the module docstring)."""
    return _load(NpyView(blob))


def to_device_many(blobs: Sequence[np.ndarray]) -> list[mx.array]:
    """Each blob's bytes in device memory, through one `mx.load`: views into one array,
    which lives until the last of them is dropped (after their installs)."""
    if len(blobs) == 1:
        return [to_device(blobs[0])]
    whole = _load(NpyView(*blobs))
    out: list[mx.array] = []
    start = 0
    for blob in blobs:
        out.append(whole[start : start + blob.nbytes])
        start += blob.nbytes
    # Evaluated here: a lazy slice belongs to this thread's stream, which no other thread
    # can evaluate ("There is no Stream(gpu, 2) in current thread"). A slice is a view.
    mx.eval(out)
    return out


def to_device_prefetched(blobs: Sequence[np.ndarray]) -> list[mx.array]:
    """Each blob's bytes in managed memory, moved onto the GPU in bulk before any kernel
    reads them (`reader.device_copy = "prefetch"`, actors/cuda_prefetch.py): one host
    memcpy per blob into MLX's own buffer, then the driver's prefetch, no pageable copy."""
    from actors import cuda_prefetch

    out = [mx.array(blob) for blob in blobs]
    cuda_prefetch.to_gpu(out)
    return out
