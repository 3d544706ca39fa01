"""Can a queued MLX graph wait on the GPU for the host, mid-token? (issue 31, fast disk)

A custom CUDA kernel (`mx.fast.cuda_kernel`) publishes a layer's routed ids into page-locked
host memory and spins until the host answers with their slots; a host thread polls the
mailbox and answers. This measures, on a chain of LAYERS small "layers", the token's time
(a) queued whole with no wait, (b) queued whole with a host handshake per layer, and
(c) stepped per layer with an eval and a read back (today's per-layer path).

    python benchmarks/await_probe.py [--layers 40] [--tokens 20]
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import mlx.core as mx
import numpy as np

from actors.cuda_driver import check, current, stream
from actors.device_wait import host_alloc

SOURCE = """
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    volatile int* box = reinterpret_cast<volatile int*>(static_cast<uintptr_t>(mbox[0]));
    int layer = meta[0]; int seq = meta[1]; int n = meta[2];
    volatile int* r = box + 64 + layer * 128;
    for (int i = 0; i < n; ++i) r[4 + i] = ids[i];
    __threadfence_system();
    r[0] = seq;
    __threadfence_system();
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (r[1] != seq) {
        if (box[0] != 0) { slots[0] = -1; return; }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 5000000000ull) { box[1] = layer + 1; slots[0] = -2; return; }
        __nanosleep(200);
    }
    __threadfence_system();
    for (int i = 0; i < n; ++i) slots[i] = r[64 + i];
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--dim", type=int, default=2048)
    args = ap.parse_args()
    box = host_alloc(64 * 4 + args.layers * 128 * 4)
    mbox = mx.array([box.ctypes.data], dtype=mx.int64)
    kernel = mx.fast.cuda_kernel(name="await_slots", input_names=["ids", "mbox", "meta"],
                                 output_names=["slots"], source=SOURCE)
    w = mx.random.normal((args.dim, args.dim)) * 0.02
    k = 8

    def layer(x: mx.array) -> tuple[mx.array, mx.array]:
        h = x @ w
        ids = mx.argpartition(-h[0, :256], k - 1)[:k].astype(mx.int32)
        return h, ids

    def token(seq: int, mode: str) -> float:
        x = mx.ones((1, args.dim))
        t0 = time.perf_counter()
        for l_ in range(args.layers):
            h, ids = layer(x)
            if mode == "await":
                meta = mx.array([l_, seq, k], dtype=mx.int32)
                slots = kernel(inputs=[ids, mbox, meta], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                               output_shapes=[(k,)], output_dtypes=[mx.int32])[0]
            elif mode == "step":
                mx.eval(ids)
                slots = mx.array([i + 1000 for i in ids.tolist()], dtype=mx.int32)
            else:
                slots = ids + 1000
            x = mx.tanh(h + slots.astype(mx.float32).sum() * 1e-6)
        mx.eval(x)
        return time.perf_counter() - t0

    waits: list[float] = []
    dmas: list[float] = []
    # A DMA into MLX's (managed) memory while the wait kernel spins: does it complete?
    target = mx.zeros((1 << 21,), dtype=mx.uint8)
    mx.eval(target)
    src = host_alloc(1 << 21)
    cu = current()
    cu.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    dst = int(np.frombuffer(memoryview(target), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]
    s = stream()
    attr = ctypes.c_int()
    cu.cuDeviceGetAttribute(ctypes.byref(attr), 89, 0)  # CONCURRENT_MANAGED_ACCESS
    print("concurrentManagedAccess", attr.value, flush=True)

    def watcher(seq: int, dma: bool = False) -> None:
        for l_ in range(args.layers):
            r = 64 + l_ * 128
            while box[r] != seq:
                time.sleep(0)  # lets the graph-building thread have the GIL
            if dma and l_ == 3:
                t = time.perf_counter()
                check(cu.cuMemcpyHtoDAsync_v2(dst, src.ctypes.data, 1 << 21, s), "copy")
                check(cu.cuStreamSynchronize(s), "sync")
                dmas.append(time.perf_counter() - t)
            t = time.perf_counter()
            ids = box[r + 4: r + 4 + k].copy()
            box[r + 64: r + 64 + k] = ids + 1000
            box[r + 1] = seq
            waits.append(time.perf_counter() - t)

    token(0, "none"), token(0, "step")
    th = threading.Thread(target=watcher, args=(1,))
    th.start()
    token(1, "await")
    th.join()
    seq = 1
    for mode in ("none", "step", "await", "none", "step", "await"):
        times = []
        for _ in range(args.tokens):
            seq += 1
            th = None
            if mode == "await":
                th = threading.Thread(target=watcher, args=(seq,))
                th.start()
            times.append(token(seq, mode))
            if th:
                th.join()
        print(f"{mode:6s} ms/token median {1e3 * float(np.median(times)):.2f} min {1e3 * min(times):.2f}"
              f" ({args.layers} layers)", flush=True)
    print("abort", box[0], "timeout", box[1], "host turn us", 1e6 * float(np.median(waits)), flush=True)
    seq += 1
    th = threading.Thread(target=watcher, args=(seq, True))
    th.start()
    t0 = time.perf_counter()
    token(seq, "await")
    th.join()
    print(f"with a DMA into managed memory mid-token: token {1e3 * (time.perf_counter() - t0):.1f} ms, "
          f"the DMA {[round(1e3 * d, 2) for d in dmas]} ms, timeout word {box[1]}", flush=True)
    # correctness: the slots the GPU read are the host's
    x = mx.ones((1, args.dim))
    h, ids = layer(x)
    seq += 1
    th = threading.Thread(target=watcher, args=(seq,), kwargs={})
    th.start()
    for l_ in range(args.layers):
        h, ids = layer(x)
        meta = mx.array([l_, seq, k], dtype=mx.int32)
        slots = kernel(inputs=[ids, mbox, meta], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                       output_shapes=[(k,)], output_dtypes=[mx.int32])[0]
        x = mx.tanh(h + slots.astype(mx.float32).sum() * 1e-6)
        if l_ == args.layers - 1:
            mx.eval(x, ids, slots)
            print("slots == ids + 1000:", bool(mx.all(slots == ids + 1000).item()))
    th.join()


if __name__ == "__main__":
    main()
