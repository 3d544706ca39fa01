"""Probe: what MLX's device runtime costs in host RSS before and after a first weight.

One fresh process, RSS after each step: the imports; the runtime up (`runtime_up`: on CUDA
the context, stream, allocator); a bf16 matmul (cuBLAS); a 4-bit `quantized_matmul` and a
`gather_qmm` (MLX's own kernels, compiled or loaded from its PTX cache); a 256 MiB array
made on the device and freed. What grows after the runtime mark without a weight held is
the runtime's lazy loading, which any MLX program pays (issue 25's host target).

    python benchmarks/runtime_rss.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from pipeline.memory_facts import runtime_up  # noqa: E402
from pipeline.resident_map import current_rss_mb, peak_rss_mb, resident_by_mapping  # noqa: E402


def mark(step: str, t0: float) -> None:
    print(f"{step:24s} {time.perf_counter() - t0:6.2f}s rss {current_rss_mb():7.0f} MiB "
          f"peak {peak_rss_mb():7.0f} | {resident_by_mapping(5)}", flush=True)


def main() -> None:
    t0 = time.perf_counter()
    mark("imports", t0)
    runtime_up()
    mark("runtime up", t0)
    a = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
    mx.eval(a @ a)
    mark("bf16 matmul", t0)
    w, s, b = mx.quantize(mx.random.normal((1024, 2048)).astype(mx.bfloat16), group_size=64, bits=4)
    x = mx.random.normal((1, 2048)).astype(mx.bfloat16)
    mx.eval(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))
    mark("quantized_matmul", t0)
    ws, ss, bs = (mx.stack([t] * 8) for t in (w, s, b))
    idx = mx.array([1, 5], dtype=mx.uint32)
    mx.eval(mx.gather_qmm(x[None], ws, ss, bs, rhs_indices=idx, transpose=True, group_size=64, bits=4))
    mark("gather_qmm", t0)
    big = mx.zeros((256 * 2**20 // 2,), dtype=mx.bfloat16)
    mx.eval(big)
    mark("256 MiB on the device", t0)
    del big
    mx.clear_cache()
    mark("freed", t0)


if __name__ == "__main__":
    main()
