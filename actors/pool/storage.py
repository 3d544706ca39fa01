"""The expert pool's memory: one MLX array per expert tensor, with a leading slot axis.

`gate_proj.weight` of every resident expert lives in one [slots, out, in/pack] array
(likewise scales, biases, up and down), so a MoE layer's routed experts are a single
`gather_qmm` over slot indices. The arrays are allocated once, at the budget, and
updated in place: MLX donates a buffer to a slice update when nothing else holds it,
which the forward pass guarantees by installing only between layers (after the
routing sync, when no lazy graph refers to the pool).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from actors.device_staging import to_device
from qpack.spec import ExpertFormat, QpackError

_MX_DTYPES = {
    "uint32": mx.uint32,
    "uint8": mx.uint8,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
    "float32": mx.float32,
}


def slot_bytes(fmt: ExpertFormat) -> int:
    return sum(t.nbytes for t in fmt.tensors)


def slots_for_budget(fmt: ExpertFormat, budget_bytes: int) -> int:
    return budget_bytes // slot_bytes(fmt)


class PoolStorage:
    def __init__(self, fmt: ExpertFormat, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"pool needs at least one slot, got {num_slots}")
        self.fmt = fmt
        self.num_slots = num_slots
        self.arrays: dict[str, mx.array] = {
            t.name: mx.zeros((num_slots, *t.shape), dtype=_MX_DTYPES[t.dtype]) for t in fmt.tensors
        }
        mx.eval(list(self.arrays.values()))
        # On the CPU the pool's memory is plain host memory: an install is a memcpy into
        # it (MLX's CPU scatter moves ~0.3 GB/s). Elsewhere installs go through MLX.
        self.host_bytes: dict[str, np.ndarray] | None = None
        if mx.default_device() == mx.cpu:
            self.host_bytes = {
                t.name: np.asarray(memoryview(self.arrays[t.name]).cast("B")).reshape(num_slots, t.nbytes)
                for t in fmt.tensors
            }

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def stage(self, blob: np.ndarray) -> mx.array:
        """An expert blob in device memory, copied in a reader's thread (see `device_staging`)."""
        return to_device(blob[: self.fmt.nbytes])

    def write(self, items: Sequence[tuple[int, np.ndarray]]) -> None:
        """CPU installs: copy blobs straight into the slots' memory, from any thread.

        Safe because a slot being written belongs to a key that is still loading: no
        forward pass reads it, and every earlier use of the slot has been evaluated
        (a layer's experts are evaluated at the next layer's routing sync, before
        their keys are unpinned and become evictable).
        """
        assert self.host_bytes is not None, "write() is for MLX's CPU backend"
        for slot, blob in items:
            for t in self.fmt.tensors:
                self.host_bytes[t.name][slot] = blob[t.offset : t.offset + t.nbytes]

    def install(self, items: Sequence[tuple[int, np.ndarray | mx.array]]) -> None:
        """Copy expert blobs (uint8, at least fmt.nbytes; numpy or staged) into their slots.

        A batch costs one host->device copy and one scatter per tensor, whatever its
        size: on a GPU per-expert slice updates cost ~25-100 us each, which added up to
        most of a decode step.
        """
        if not items:
            return
        slots = mx.array([slot for slot, _ in items], dtype=mx.int32)
        if isinstance(items[0][1], mx.array):
            blobs = mx.stack([blob[: self.fmt.nbytes] for _, blob in items])
        else:
            blobs = mx.array(np.stack([blob[: self.fmt.nbytes] for _, blob in items]))
        n = len(items)
        for t in self.fmt.tensors:
            raw = blobs[:, t.offset : t.offset + t.nbytes]
            value = raw.view(_MX_DTYPES[t.dtype]).reshape(n, *t.shape)
            self.arrays[t.name][slots] = value
        mx.eval(list(self.arrays.values()))


def uniform_format(formats: Sequence[ExpertFormat], where: str) -> ExpertFormat:
    """The pool holds experts of every layer in shared slots, so their layouts must agree."""
    first = formats[0]
    for fmt in formats[1:]:
        if fmt != first:
            raise QpackError(where, "MoE layers have different expert layouts; one pool cannot hold them")
    return first
