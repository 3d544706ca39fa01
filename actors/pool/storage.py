"""The expert pool's memory: one MLX array per expert tensor, with a leading slot axis.

`gate_proj.weight` of every resident expert lives in one [slots, out, in/pack] array
(likewise scales, biases, up and down), so a MoE layer's routed experts are a single
`gather_qmm` over slot indices. The arrays are allocated once, at the budget, and
updated in place: MLX donates a buffer to a slice update when nothing else holds it,
which the forward pass guarantees by installing only between layers (after the
routing sync, when no lazy graph refers to the pool).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np

from actors.cuda_driver import gpu_memory_bytes, on_cuda
from actors.device_staging import to_device_many, to_device_prefetched
from actors.libc import glibc
from actors.pool.banks import Banks
from actors.pool.direct_install import direct_copies
from actors.pool.layout import PoolLayout
from qpack.spec import ExpertFormat, QpackError, TensorSpec

if TYPE_CHECKING:
    from actors.cuda_direct import DirectWriter

_MX_DTYPES = {
    "uint32": mx.uint32,
    "uint8": mx.uint8,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
    "float32": mx.float32,
}


_PAGE = 4096 if not hasattr(os, "sysconf") else os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = 4  # Linux


def _madvise() -> Callable[..., int] | None:
    return glibc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)


def slot_bytes(fmt: ExpertFormat | PoolLayout) -> int:
    if isinstance(fmt, PoolLayout):
        return fmt.slot_nbytes
    return sum(t.nbytes for t in fmt.tensors)


def slots_for_budget(fmt: ExpertFormat | PoolLayout, budget_bytes: int) -> int:
    return budget_bytes // slot_bytes(fmt)


class PoolAllocationError(MemoryError):
    """The pool's arrays would not fit in the memory there is: refused before MLX tries."""


def check_allocatable(nbytes: int) -> None:
    """MLX does not survive an allocation that fails (the process segfaults, rc 139), so a
    pool larger than the memory that could hold it is refused here, whoever sized it: the
    engine checks explicit budgets with a margin first (pipeline.memory_budget); this is
    the last guard, without the margin, for every caller."""
    import psutil

    if not on_cuda():
        room, where = psutil.virtual_memory().available, "available host memory"
    else:
        room = gpu_memory_bytes() or nbytes
        where = "the GPU's memory"
    if nbytes > room:
        raise PoolAllocationError(f"expert pool of {nbytes / 2**20:,.0f} MiB cannot be allocated: "
                                  f"{where} is {room / 2**20:,.0f} MiB; use a smaller pool")


class PoolStorage:
    """The slot arrays. Built from one format (every layer alike) or a `PoolLayout` (layers
    differ: mixed precision); then `layer_of(slot)` must say whose expert a slot holds
    while it is being installed (the engine binds it to the slot table)."""

    def __init__(self, fmt: ExpertFormat | PoolLayout, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"pool needs at least one slot, got {num_slots}")
        self.layout = fmt if isinstance(fmt, PoolLayout) else PoolLayout.uniform(fmt)
        self.fmt = self.layout.formats[next(iter(self.layout.formats))]  # the uniform case's format
        self.num_slots = num_slots
        self.layer_of: Callable[[int], int | None] | None = None
        # Set by the engine before any compute when the pool is larger than the expert
        # kernels index safely (actors/pool/banks.py).
        self.banks: Banks | None = None
        self._views: dict[int, tuple[dict[str, mx.array], ExpertFormat, int]] = {}  # `view`'s
        self._views_of: Banks | None = None  # the banks they were cut for
        # How a reader's staging thread moves blobs to the GPU (`reader.device_copy`), or
        # (`direct`) how installs write the staging buffers into the slots by DMA.
        self.prefetch_copy = False
        self.direct: DirectWriter | None = None
        check_allocatable(self.layout.slot_nbytes * num_slots)
        self.arrays: dict[str, mx.array] = {
            name: mx.zeros((num_slots, *shape), dtype=_MX_DTYPES[dtype])
            for name, (dtype, shape, _) in self.layout.arrays.items()
        }
        mx.eval(list(self.arrays.values()))
        # On the CPU the pool's memory is plain host memory: an install is a memcpy into
        # it (MLX's CPU scatter moves ~0.3 GB/s). Elsewhere installs go through MLX.
        self.host_bytes: dict[str, np.ndarray] | None = None
        self._host_base: dict[str, int] = {}  # their addresses (copy_ranges): they never move
        if mx.default_device() == mx.cpu:
            self.host_bytes = {
                # MLX arrays have the buffer protocol; MLX's stubs do not declare it.
                name: np.asarray(memoryview(self.arrays[name]).cast("B"))  # type: ignore[arg-type]
                .reshape(num_slots, nbytes)
                for name, (_, _, nbytes) in self.layout.arrays.items()
            }
            self._host_base = {name: int(rows.ctypes.data) for name, rows in self.host_bytes.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def view(self, layer: int) -> tuple[dict[str, mx.array], ExpertFormat, int]:
        """`layer`'s experts for compute: tensor name -> slot array, their format, and the
        slot the arrays start at. With banks, the arrays are the layer's bank's slice of
        the pool's (an offset, not a copy) and a slot s is row s - start of them.

        Made once per layer and kept: a token's graph otherwise holds nine new slices a
        MoE layer (views, but nodes MLX walks and encodes, and Python that builds them),
        until the pool's arrays are replaced (`install`'s scatter) or the banks set."""
        if self._views_of is not self.banks:
            self._views, self._views_of = {}, self.banks
        view = self._views.get(layer)
        if view is None:
            fmt, names = self.layout.layer(layer)
            if self.banks is None:
                view = {t: self.arrays[a] for t, a in names.items()}, fmt, 0
            else:
                bank = self.banks.of_layer(layer)
                view = {t: self.arrays[a][bank.start:bank.stop] for t, a in names.items()}, fmt, bank.start
            self._views[layer] = view
        return view

    def _layer_format(self, slot: int) -> tuple[ExpertFormat, dict[str, str]]:
        if not self.layout.mixed:
            return self.layout.layer(None)
        if self.layer_of is None:
            raise RuntimeError("a pool of mixed formats needs layer_of(slot) to install")
        return self.layout.layer(self.layer_of(slot))

    def stage(self, blobs: Sequence[np.ndarray]) -> list[mx.array]:
        """Expert blobs in device memory, copied together in a reader's staging thread
        (see `device_staging`)."""
        cut = [blob[: self.layout.max_nbytes] for blob in blobs]
        return to_device_prefetched(cut) if self.prefetch_copy else to_device_many(cut)

    def _copy_in(self, name: str, slot: int, t: TensorSpec, src: np.ndarray) -> None:
        """A tensor's blob bytes into its slot row, widened when the pool stores it wider."""
        row = self.host_bytes[name][slot]  # type: ignore[index]
        if row.nbytes == t.nbytes:
            row[:] = src
        elif t.dtype == "bfloat16":  # bfloat16 is float32's top half: shift it up
            row.view(np.uint32)[:] = src.view(np.uint16).astype(np.uint32) << 16
        else:
            row.view(np.float32)[:] = src.view(np.float16)

    def release(self, slots: Sequence[int]) -> int:
        """Hand the memory of withdrawn slots back to the OS (CPU pools on Linux: their
        rows' whole pages, MADV_DONTNEED; they read as zeros until written again). The
        slots must hold no key. Returns the bytes released (0 where it cannot)."""
        if self.host_bytes is None or not slots:
            return 0
        madvise = _madvise()
        if madvise is None:
            return 0
        released = 0
        for rows in self.host_bytes.values():
            for slot in slots:
                row = rows[slot]
                start = -(-row.ctypes.data // _PAGE) * _PAGE
                end = (row.ctypes.data + row.nbytes) // _PAGE * _PAGE
                if end > start and madvise(start, end - start, _MADV_DONTNEED) == 0:
                    released += end - start
        return released

    def write(self, items: Sequence[tuple[int, np.ndarray]]) -> None:
        """CPU installs: copy blobs straight into the slots' memory, from any thread.

        Safe because a slot being written belongs to a key that is still loading: no
        forward pass reads it, and every earlier use of the slot has been evaluated
        (a layer's experts are evaluated at the next layer's routing sync, before
        their keys are unpinned and become evictable).
        """
        assert self.host_bytes is not None, "write() is for MLX's CPU backend"
        for slot, blob in items:
            self._write_blob(slot, self._layer_format(slot), blob)

    def _write_blob(self, slot: int, fmt_names: tuple[ExpertFormat, dict[str, str]],
                    blob: np.ndarray) -> None:
        """CPU: every tensor of one blob into its slot row."""
        fmt, names = fmt_names
        for t in fmt.tensors:
            self._copy_in(names[t.name], slot, t, blob[t.offset : t.offset + t.nbytes])

    def land(self, items: Sequence[tuple[int, int, np.ndarray]]) -> None:
        """(slot, layer, blob)s into their slots from a staging thread, where they landed
        (actors/reader.py, "Landing"; the router allows it only for slots no queued kernel
        reads): memcpys on the CPU, DMAs from the pinned staging buffers on CUDA, waited
        for together on this thread's own stream (never MLX's: the MLX thread is not
        involved). The format goes by the layer given, not the slot table's (this thread
        must not read the router's state)."""
        formats = {slot: self.layout.layer(layer) for slot, layer, _ in items}
        if self.host_bytes is not None:
            for slot, _, blob in items:
                self._write_blob(slot, formats[slot], blob)
            return
        assert self.direct is not None, "landing on a GPU needs a probed DirectWriter"
        self.direct.write_now(direct_copies(self.layout, self.direct.base,
                                            [(slot, blob) for slot, _, blob in items], formats.__getitem__))

    @property
    def can_land(self) -> bool:
        """Whether `land` works here: host memory (CPU) or the probed direct path."""
        return self.host_bytes is not None or self.direct is not None

    def install_direct(self, items: Sequence[tuple[int, np.ndarray]]) -> None:
        """GPU installs by DMA from the (pinned) staging buffers, on the MLX thread
        (actors/cuda_direct.py says why that is safe)."""
        assert self.direct is not None, "install_direct needs a probed DirectWriter"
        self.direct.write(self.copy_ranges(items))

    def copy_ranges(self, items: Sequence[tuple[int, np.ndarray]]) -> list[tuple[int, int, int]]:
        """The copies (pool address, blob address, bytes) that install `items`: DMAs on the
        direct path, memmoves into a host pool (read where the slot table is: the router's
        thread)."""
        if self.host_bytes is not None:
            base = self._host_base
        else:
            assert self.direct is not None, "copies need host memory or a probed DirectWriter"
            base = self.direct.base
        return direct_copies(self.layout, base, items, self._layer_format)

    def install(self, items: Sequence[tuple[int, np.ndarray | mx.array]]) -> None:
        """Copy expert blobs (uint8, at least fmt.nbytes; numpy or staged) into their slots.

        A batch costs one host->device copy and one scatter per tensor (per format, when
        layers differ), whatever its size: on a GPU per-expert slice updates cost
        ~25-100 us each, which added up to most of a decode step.
        """
        if not items:
            return
        # The scatter below replaces the arrays: views of the old ones would keep them
        # alive (and make MLX copy the whole pool rather than update it in place).
        self._views.clear()
        groups: dict[int, tuple[ExpertFormat, dict[str, str], list[tuple[int, np.ndarray | mx.array]]]] = {}
        for slot, blob in items:
            fmt, names = self._layer_format(slot)
            groups.setdefault(id(names), (fmt, names, []))[2].append((slot, blob))
        for fmt, names, group in groups.values():
            slots = mx.array([slot for slot, _ in group], dtype=mx.int32)
            if isinstance(group[0][1], mx.array):  # a reader stages all its blobs or none
                blobs = mx.stack([cast(mx.array, blob)[: fmt.nbytes] for _, blob in group])
            else:
                blobs = mx.array(np.stack([blob[: fmt.nbytes] for _, blob in group]))
            n = len(group)
            for t in fmt.tensors:
                raw = blobs[:, t.offset : t.offset + t.nbytes]
                value = raw.view(_MX_DTYPES[t.dtype]).reshape(n, *t.shape)
                target = self.arrays[names[t.name]]
                target[slots] = value.astype(target.dtype)  # a no-op unless widened
        mx.eval(list(self.arrays.values()))


def uniform_format(formats: Sequence[ExpertFormat], where: str) -> ExpertFormat:
    """The pool holds experts of every layer in shared slots, so their layouts must agree
    (callers that can take mixed formats build a `PoolLayout` instead)."""
    first = formats[0]
    for fmt in formats[1:]:
        if fmt != first:
            raise QpackError(where, "MoE layers have different expert layouts; one pool cannot hold them")
    return first
