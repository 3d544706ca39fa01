"""A minimal io_uring for positional reads, driven with ctypes (no third-party binding).

Why: with threads, every expert read returns into Python on its own disk thread, which
must take the GIL back before it can start the next read or hand the blob on; with the
event loop, the MLX thread's graph building and the staging threads all wanting the GIL,
a page-cache read of 1.6 MiB that copies in ~0.25 ms took ~0.45 ms on the H200 (session 26
timeline), and more threads made each slower. A ring keeps many reads in flight on the
kernel's own workers (`IOSQE_ASYNC`: a cached read is otherwise copied inline, on the
submitting thread) and one thread collects any number of completions per return into
Python: one GIL acquisition per batch of reads, not one per read.

x86-64 Linux only: the submission ring's tail is published with a plain store, which
x86's ordering makes a release store; elsewhere it would need a barrier Python cannot
issue. `Ring` raises `OSError` where io_uring is missing or forbidden (old kernels,
seccomp-filtered containers): the caller falls back to threads.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import time

_NR_SETUP, _NR_ENTER = 425, 426  # x86-64 (and arm64) system call numbers
_OP_READ = 22  # IORING_OP_READ
_SQE_ASYNC = 1 << 4  # IOSQE_ASYNC: to the ring's workers, never inline
_ENTER_GETEVENTS = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_SQE = struct.Struct("BBHiQQIIQ")  # opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data
_CQE = struct.Struct("Qi")  # user_data, res
_U32 = struct.Struct("I")


def supported() -> bool:
    """Whether this platform can use `Ring` at all (it may still be refused at setup)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


class Ring:
    """Reads submitted from one thread, completions reaped by the same thread."""

    def __init__(self, entries: int) -> None:
        if not supported():
            raise OSError(f"io_uring reads need x86-64 Linux, not {sys.platform}/{platform.machine()}")
        self._libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
        params = (ctypes.c_uint8 * 120)()
        fd = self._libc.syscall(_NR_SETUP, max(2, entries), ctypes.byref(params))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        raw = bytes(params)
        sq_entries, cq_entries = struct.unpack_from("II", raw, 0)
        sq = struct.unpack_from("IIIIIII", raw, 40)  # head tail mask entries flags dropped array
        cq = struct.unpack_from("IIIIII", raw, 80)  # head tail mask entries overflow cqes
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        try:
            self._sq = mmap.mmap(fd, sq[6] + sq_entries * 4, flags, prot, offset=_OFF_SQ_RING)
            self._cq = mmap.mmap(fd, cq[5] + cq_entries * 16, flags, prot, offset=_OFF_CQ_RING)
            self._sqes = mmap.mmap(fd, sq_entries * 64, flags, prot, offset=_OFF_SQES)
        except OSError:
            os.close(fd)
            raise
        self.entries = sq_entries
        self._sq_head, self._sq_tail, self._sq_array = sq[0], sq[1], sq[6]
        self._cq_head, self._cq_tail, self._cqes = cq[0], cq[1], cq[5]
        self._mask = _U32.unpack_from(self._sq, sq[2])[0]
        self._cmask = _U32.unpack_from(self._cq, cq[2])[0]

    def read(self, fd: int, addr: int, nbytes: int, offset: int, tag: int, *,
             on_workers: bool = True) -> None:
        """Queue a read of `nbytes` at `offset` of `fd` into the memory at `addr` (which must
        stay alive until its completion); `on_workers`: IOSQE_ASYNC. Submitted by `enter`."""
        tail = _U32.unpack_from(self._sq, self._sq_tail)[0]
        index = tail & self._mask
        _SQE.pack_into(self._sqes, index * 64, _OP_READ, _SQE_ASYNC if on_workers else 0, 0,
                       fd, offset, addr, nbytes, 0, tag)
        self._sqes[index * 64 + _SQE.size : index * 64 + 64] = bytes(64 - _SQE.size)
        _U32.pack_into(self._sq, self._sq_array + index * 4, index)
        _U32.pack_into(self._sq, self._sq_tail, (tail + 1) & 0xFFFFFFFF)  # x86: a release store

    def enter(self, wait: int) -> None:
        """Hand the queued reads to the kernel and, if `wait`, block (without the GIL)
        until at least `wait` completions are there to reap."""
        while True:
            # Every entry the kernel has not consumed yet (after an EINTR: those it did not).
            submit = (_U32.unpack_from(self._sq, self._sq_tail)[0]
                      - _U32.unpack_from(self._sq, self._sq_head)[0]) & 0xFFFFFFFF
            got = self._libc.syscall(_NR_ENTER, self.fd, submit, wait,
                                     _ENTER_GETEVENTS if wait else 0, None, 0)
            if got >= 0:
                return
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EBUSY):
                # Out of resources for now, or completions to reap first: the caller reaps
                # what is there and enters again (liburing's answer), after a breath.
                time.sleep(0.0002)
                return
            if err != errno.EINTR:  # a signal landed on this thread: enter again
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def reap(self) -> list[tuple[int, int]]:
        """Every completion there now: (tag, bytes read or -errno)."""
        head = _U32.unpack_from(self._cq, self._cq_head)[0]
        tail = _U32.unpack_from(self._cq, self._cq_tail)[0]
        done = []
        while head != tail:
            done.append(_CQE.unpack_from(self._cq, self._cqes + (head & self._cmask) * 16))
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(self._cq, self._cq_head, head)
        return done

    def close(self) -> None:
        for m in (self._sq, self._cq, self._sqes):
            m.close()
        os.close(self.fd)
