"""The GPU waits for the host inside a queued graph: a decode token queued whole while its
experts are still being read (issue 31, the fast disk).

Stepping a token layer by layer costs a host sync, a graph build and an MLX call per MoE
layer: ~3-4 ms a layer on the H200 with the container in the page cache (a fast disk's
stand-in), against ~0.6 ms of GPU work, so decode ran at 0.13-0.28 of what that disk and
the GPU could do (docs/results.md). Here the whole token is built and queued at once, and
each MoE layer's experts come from a custom kernel (`mx.fast.cuda_kernel`) between its
router and its expert matmuls that

1. writes the layer's chosen ids (and the gate strategy's ranking for the next layers)
   into page-locked host memory, the layer's mailbox, and marks it published;
2. spins (on the GPU) until the host answers with each id's pool slot; meanwhile its
   grid makes the copies the host lists for that layer as reads end (pool address,
   staging buffer address, bytes: the installs), pulling the blobs from the page-locked
   staging buffers, so the copies fill the time the GPU waits anyway; it makes the ones
   listed last, and outputs the slots, before it ends.

The host side (`actors/awaited.py`, `queued_whole`) polls the mailboxes from the
compute task, demands each layer's experts from the router as the per-layer path does
(the same requests in the same order), and answers once they are read; the reads of the
next layers overlap the GPU's work in between. One host sync per token, however many
reads it waits for. The answer is plain stores into page-locked memory: no CUDA call.
That matters: a DMA of the host's own (the first version) waited behind the token on the
H200 (session 21), as any driver call may while something synchronizes the context (a
module MLX loads on first use, an allocation or a free of its: CUDA's lazy-loading
hazard) and the GPU spins waiting for the host.

Safety. The answer for layer l is written after its experts are read and pinned; they
stay pinned until layer l+1 is demanded, which the host does only after the GPU has
published l+1's routing, i.e. after every kernel reading layer l's experts (and the copies
of l's answer) has run: they all feed the residual stream l+1 routes from. So a slot
taken for a read during the token is read by no queued kernel, a copy into it is made
before any kernel that reads it, and its staging buffer goes back to the reader once the
next layer is published. Nothing lands meanwhile (a landing is a DMA).

A kernel that waits more than `TIMEOUT_S` (or whose token the host aborts: an error,
a cancellation, no staging buffer left for a read) outputs slot -1 for its layer and
every later one, as a run-ahead's missing expert does: the copies it may not have made
are made once the MLX call returns, and the token is redone from there, layer by layer.
Measured (benchmarks/await_probe.py, H200, 2026-12-04): a host answer per layer costs
~47 us of GPU time, 40 layers 1.9 ms a token, against 13.7 ms stepped per layer. In the
engine (session 22, docs/results.md): tokens equal to stepping's, 1.13x on a 4-layer cut
and 0.90-0.95x on the full 35B, where the host's answer (~1.4 ms a layer) is the cost.

CUDA only (`probe` says where it works); page-locked through the CUDA driver
(actors/cuda_driver.py), addressed by the GPU at the same address (unified addressing).
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np
import structlog

from actors.cuda_driver import CudaDriverError, check, current, on_cuda
from actors.device_wait_kernel import (
    BLOCKS,
    COPIES_AT,
    EXTRA_AT,
    HEADER,
    IDS_AT,
    MAX_COPIES,
    MAX_EXTRA,
    MAX_IDS,
    SEQ_WORD,
    SLOTS_AT,
    SOURCE,
    THREADS,
    TIMES,
    TIMES_AT,
    WORDS,
    Copy,
)
from actors.mx_typed import to_int

if TYPE_CHECKING:
    from actors.cuda_direct import DirectWriter

log = structlog.get_logger("moestream.device_wait")

# Longer than a layer's reads take even on a slow disk; a wait that gives up only costs a
# redo of the token per layer (a disk that hangs is the reader's retries' business).
TIMEOUT_S = 10.0
def host_alloc(nbytes: int) -> np.ndarray:
    """Page-locked, device-mapped host memory as int32 words, freed with the array."""
    cu = current()
    cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
    cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
    ptr = ctypes.c_void_p()
    check(cu.cuMemHostAlloc(ctypes.byref(ptr), nbytes, 1 | 2), "cuMemHostAlloc")  # PORTABLE | DEVICEMAP
    words = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int32)), shape=(nbytes // 4,))
    words[:] = 0
    owner = np.asarray(words)  # the view numpy hands out; freed when it goes
    weakref.finalize(owner, cu.cuMemFreeHost, ptr.value)
    return owner


class Mailboxes:
    """The mailboxes of `rows` MoE layers (in their order), the host's side of them."""

    def __init__(self, box: np.ndarray, rows: int) -> None:
        self.box = box  # int32 words, (rows + 1) * WORDS of them, zeroed
        self.rows = rows
        self._seq = 0
        # Each row's GPU clock stamps (TIMES of them), as int64 indices into the box (`gpu_times`).
        firsts = [((row + 1) * WORDS + TIMES_AT) // 2 for row in range(rows)]
        self._times_at = np.array(firsts)[:, None] + np.arange(TIMES)

    def next_seq(self) -> int:
        """The next token's seq, also written where its kernels read it (`SEQ_WORD`)."""
        self._seq = self._seq % (1 << 30) + 1
        self.box[SEQ_WORD] = self._seq
        return self._seq

    def _at(self, row: int) -> int:
        return (row + 1) * WORDS

    def published(self, row: int, seq: int) -> bool:
        return int(self.box[self._at(row)]) == seq

    def routed(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """A published layer's ids and extra, copied out."""
        r = self._at(row)
        n, m = int(self.box[r + 2]), int(self.box[r + 3])
        return (self.box[r + IDS_AT : r + IDS_AT + n].copy(),
                self.box[r + EXTRA_AT : r + EXTRA_AT + m].copy())

    def begin(self) -> None:
        """A token starts: every layer's list of copies is empty."""
        for row in range(self.rows):
            self.box[self._at(row) + 4] = 0

    def append(self, row: int, copies: list[Copy]) -> None:
        """Copies for layer `row`'s wait to make (while it waits, or right after its
        answer), before any kernel reads their slots."""
        r = self._at(row)
        have = int(self.box[r + 4])
        if have + len(copies) > MAX_COPIES:
            raise ValueError(f"device wait: {have + len(copies)} copies exceed the mailbox ({MAX_COPIES})")
        if copies:
            at = (r + COPIES_AT) // 2 + 3 * have
            self.box.view(np.int64)[at : at + 3 * len(copies)] = np.asarray(copies, dtype=np.int64).reshape(-1)
            self.box[r + 4] = have + len(copies)  # after the entries: stores reach the device in order

    def answer(self, row: int, seq: int, slots: np.ndarray) -> None:
        """The slots of the published ids, in their order (after the layer's last copies
        were appended); the GPU goes on."""
        r = self._at(row)
        self.box[r + SLOTS_AT : r + SLOTS_AT + slots.size] = slots
        self.box[r + 1] = seq  # after the rest: x86 stores reach the device in order

    def copies(self, row: int) -> list[Copy]:
        """The copies listed for layer `row` (this token's)."""
        r = self._at(row)
        at, n = (r + COPIES_AT) // 2, int(self.box[r + 4])
        flat = self.box.view(np.int64)[at : at + 3 * n].tolist()
        return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]

    def gpu_times(self) -> np.ndarray:
        """[rows, TIMES] GPU clock (ns) of each layer's wait: published, answer seen,
        ended, the last look that found no answer (0: the first found it); zeros where no
        kernel wrote them (HostWait, a wait given up). Read once the token is done: the
        kernel writes them as it runs."""
        return self.box.view(np.int64)[self._times_at]

    def abort(self, seq: int) -> None:
        """Every wait of token `seq`, now or later, gives up (outputs -1)."""
        self.box[0] = seq

    def aborted(self, seq: int) -> bool:
        return int(self.box[0]) == seq

    @staticmethod
    def _check(n: int, m: int) -> None:
        if n > MAX_IDS or m > MAX_EXTRA:
            raise ValueError(f"device wait: {n} ids / {m} extra exceed the mailbox ({MAX_IDS} / {MAX_EXTRA})")

    def wait_slots(self, row: int, seq: int, ids: mx.array, extra: mx.array | None = None) -> mx.array:
        """On the MLX thread, in the token's graph: the slots of `ids` (any shape) once the
        host answers layer `row` of token `seq`; -1 everywhere if it gives up. `extra`: more
        ids to publish with them (a gate's ranking of the next layers)."""
        raise NotImplementedError


class DeviceWait(Mailboxes):
    """The mailboxes in page-locked memory, waited on by a kernel on the GPU."""

    def __init__(self, rows: int) -> None:
        super().__init__(host_alloc((rows + 1) * WORDS * 4), rows)
        self._mbox = mx.array([self.box.ctypes.data], dtype=mx.int64)
        self._none = mx.zeros((1,), dtype=mx.int32)
        # Each row's constants, made once: a host array made per layer and token (40 a
        # token) is an allocation and a write into managed memory on the MLX thread, and
        # one that blocked in CUDA while a wait spun hung the event loop (session 25). The
        # token's seq is read from the mailbox (`next_seq`).
        self._metas: dict[tuple[int, int, int, int], mx.array] = {}
        self._kernel = cast(Callable[..., list[mx.array]], mx.fast.cuda_kernel(
            name="moestream_wait_grid", input_names=["ids", "extra", "mbox", "meta"],
            output_names=["slots", "ctl"], source=SOURCE, header=HEADER))

    def wait_slots(self, row: int, seq: int, ids: mx.array, extra: mx.array | None = None) -> mx.array:
        return self.wait_within(row, seq, ids, extra, TIMEOUT_S)

    def wait_within(self, row: int, seq: int, ids: mx.array, extra: mx.array | None, timeout_s: float) -> mx.array:
        """`wait_slots`, giving up after `timeout_s`."""
        flat = ids.reshape(-1).astype(mx.int32)
        more = self._none if extra is None else extra.reshape(-1).astype(mx.int32)
        n, m = flat.size, 0 if extra is None else more.size
        self._check(n, m)
        if seq != int(self.box[SEQ_WORD]):
            raise ValueError(f"device wait: token {seq} is not the mailbox's ({int(self.box[SEQ_WORD])}): next_seq first")
        shape = (row, n, m, int(timeout_s * 1000))
        meta = self._metas.get(shape)
        if meta is None:
            meta = self._metas[shape] = mx.array(shape, dtype=mx.int32)
            mx.eval(meta)
        out = self._kernel(inputs=[flat, more, self._mbox, meta], grid=(THREADS * BLOCKS, 1, 1),
                           threadgroup=(THREADS, 1, 1), output_shapes=[(n,), (2,)],
                           output_dtypes=[mx.int32, mx.int32], init_value=0)[0]
        return out.reshape(ids.shape)


class HostWait(Mailboxes):
    """The same protocol with the wait on the MLX thread (`compute.device_wait =
    "emulate"`): each layer's routing is evaluated where its wait is built, published, and
    the thread waits for the answer. One sync per MoE layer, as stepping has, so nothing is
    gained; it runs the host's side (actors/awaited.py) on any backend, for tests."""

    def __init__(self, rows: int) -> None:
        super().__init__(np.zeros((rows + 1) * WORDS, dtype=np.int32), rows)
        self.copied_waiting = 0  # copies made before their layer's answer (the reads streamed)

    def wait_slots(self, row: int, seq: int, ids: mx.array, extra: mx.array | None = None) -> mx.array:
        mx.eval(ids, *([] if extra is None else [extra]))
        flat = np.asarray(ids).reshape(-1).astype(np.int32)
        more = np.zeros(0, dtype=np.int32) if extra is None else np.asarray(extra).reshape(-1).astype(np.int32)
        self._check(flat.size, more.size)
        r = self._at(row)
        box = self.box
        if self.aborted(seq):
            return mx.full(ids.shape, -1, dtype=mx.int32)
        box[r + IDS_AT : r + IDS_AT + flat.size] = flat
        box[r + EXTRA_AT : r + EXTRA_AT + more.size] = more
        box[r + 2], box[r + 3] = flat.size, more.size
        box[r] = seq
        deadline, done = time.monotonic() + TIMEOUT_S, 0
        while True:  # the copies listed so far made while waiting, as the GPU's wait does
            answered = int(box[r + 1]) == seq
            if int(box[r + 4]) > done:  # listed since the last look
                for dst, src, nbytes in self.copies(row)[done:]:
                    ctypes.memmove(dst, src, nbytes)
                    done += 1
                    self.copied_waiting += not answered
            if answered:
                break
            if self.aborted(seq):
                return mx.full(ids.shape, -1, dtype=mx.int32)
            if time.monotonic() > deadline:
                self.abort(seq)
                box[1] += 1
                return mx.full(ids.shape, -1, dtype=mx.int32)
            time.sleep(2e-5)
        slots = box[r + SLOTS_AT : r + SLOTS_AT + flat.size].copy()
        return mx.array(slots).reshape(ids.shape)


def probe(rows: int, writer: DirectWriter, name: str) -> DeviceWait | None:
    """A `DeviceWait` for `rows` layers where a queued wait sees a host thread's answer and
    the copy it asks for (a pattern into the last row of the pool array `name`, which
    `writer` writes) is what a kernel queued behind it reads; None elsewhere (not CUDA, a
    failure). The row is zeroed again, as `cuda_direct.probe` leaves its own. On the MLX
    thread; compiles the kernels once."""
    if not on_cuda():
        return None
    from actors.cuda_direct import pin

    pool = writer.arrays[name]
    nbytes = pool.nbytes // pool.shape[0]
    row_address = writer.base[name] + (pool.shape[0] - 1) * nbytes
    try:
        wait = DeviceWait(rows)
        ids = mx.array([[3, 1, 2]], dtype=mx.int32)
        mx.eval(wait.wait_within(rows - 1, 0, ids, None, 0.0))  # compiled outside the timed wait
        seq = wait.next_seq()
        pattern = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        pin(pattern)
        copies = [(row_address, pattern.ctypes.data, nbytes)]
        slots = wait.wait_within(rows - 1, seq, ids, mx.array([7], dtype=mx.int32), 10.0)
        # The row's index comes out of the wait's slots: read only after the wait and its copy
        # (an index of its own lets MLX schedule the read first).
        last = slots.reshape(-1)[:1] * 0 + (pool.shape[0] - 1)
        seen = mx.take(pool, last, axis=0).reshape(-1).view(mx.uint8).astype(mx.int64).sum()
        after = [slots, seen]

        def host() -> None:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                if wait.published(rows - 1, seq):
                    got, extra = wait.routed(rows - 1)
                    wait.append(rows - 1, copies)
                    wait.answer(rows - 1, seq, got * 10 + int(extra[0]))
                    return
                time.sleep(1e-4)
            wait.abort(seq)

        helper = threading.Thread(target=host, name="moestream-wait-probe", daemon=True)
        helper.start()
        mx.eval(after)
        helper.join()
        want = int(pattern.astype(np.int64).sum())
        got_slots, seen_sum, timeouts = after[0].tolist(), to_int(after[1]), int(wait.box[1])
        if got_slots == [[37, 17, 27]] and seen_sum == want and timeouts == 0:
            return wait
        log.warning("device_wait.probe_mismatch", slots=got_slots, row_sum=seen_sum, want=want,
                    timeouts=timeouts, row_bytes=nbytes)
        return None
    except (CudaDriverError, AttributeError, ValueError, TypeError, RuntimeError) as exc:
        # A kernel that does not compile says why here (the engine steps per layer).
        log.warning("device_wait.probe_failed", error=str(exc)[:2000])
        return None
    finally:  # whatever the wait did with the row
        zeros = np.zeros(nbytes, dtype=np.uint8)  # held: the copy reads it before the return
        pin(zeros)
        writer.write([(row_address, zeros.ctypes.data, nbytes)])
