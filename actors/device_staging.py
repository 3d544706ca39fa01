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
from typing import Any

import mlx.core as mx
import numpy as np
from numpy.lib import format as npy_format


def _npy_header(nbytes: int) -> bytes:
    out = io.BytesIO()
    npy_format.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False, "shape": (nbytes,)})
    return out.getvalue()


class NpyView:
    """A read-only file object over (`.npy` header, blob); what `mx.load` needs of one."""

    closed = False

    def __init__(self, blob: np.ndarray) -> None:
        self._head = _npy_header(blob.nbytes)
        self._blob = memoryview(blob).cast("B")
        self._size = len(self._head) + len(self._blob)
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
        for start, part in ((0, self._head), (len(self._head), self._blob)):
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


def to_device(blob: np.ndarray) -> mx.array:
    """The blob's bytes as a uint8 MLX array in device memory (see the module docstring)."""
    return mx.load(NpyView(blob), format="npy")
