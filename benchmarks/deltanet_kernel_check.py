"""The CUDA Gated DeltaNet kernel (pipeline/models/deltanet_kernel.py) against mlx-lm's
ops path on random inputs at a model's DeltaNet dimensions: the largest difference in y
and the state, wall time per call and MLX's peak memory, for a decode step and prompts.

    python benchmarks/deltanet_kernel_check.py [--tokens 1 16 1024] [--batch 2]

Prints one JSON line per case. Needs a CUDA GPU (elsewhere the kernel does not apply).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g

from actors.mx_typed import to_float
from pipeline.models import deltanet_kernel


def inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
    """Inputs scaled as the model feeds them (q, k l2-normed, a decay near one)."""
    q, k = (mx.random.normal((b, t, hk, dk)) for _ in range(2))
    q = (q / mx.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5).astype(dtype)
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((b, t, hv, dv)).astype(dtype)
    g = compute_g(mx.random.normal((hv,)) - 2, mx.random.normal((b, t, hv)).astype(dtype),
                  mx.zeros((hv,), dtype=dtype))
    beta = mx.sigmoid(mx.random.normal((b, t, hv))).astype(dtype)
    state = mx.random.normal((b, hv, dv, dk)) * 0.1
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def padding(b: int, t: int) -> mx.array | None:
    """With two rows or more, the first padded on the left by a quarter of `t`, as batched
    prefill pads: the mask [B, T]; one row, None."""
    if b < 2:
        return None
    return mx.arange(t)[None, :] >= mx.array([t // 4] + [0] * (b - 1))[:, None]


def differences(y0: mx.array, s0: mx.array, y1: mx.array, s1: mx.array,
                mask: mx.array | None) -> tuple[float, float, float]:
    """The largest differences in y (where the mask keeps a position: a padded one's y is
    undefined in the ops path) and in the state, and the largest |y| of the first."""
    if mask is not None:
        keep = mask[..., None, None]
        y0, y1 = mx.where(keep, y0, 0), mx.where(keep, y1, 0)
    dy = mx.abs(y0.astype(mx.float32) - y1.astype(mx.float32)).max()
    return to_float(dy), to_float(mx.abs(s0 - s1).max()), to_float(mx.abs(y0).max())


def timed(fn: object, args: tuple[mx.array, ...], repeat: int) -> tuple[float, float, tuple[mx.array, mx.array]]:
    out = fn(*args)  # type: ignore[operator]
    mx.eval(out)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)  # type: ignore[operator]
        mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3, (mx.get_peak_memory() - base) / 2**20, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 32], help="key and value heads (35B: 16 32)")
    ap.add_argument("--dims", type=int, nargs=2, default=[128, 128], help="Dk and Dv")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    deltanet_kernel.install()
    assert deltanet_kernel._original is not None
    original = deltanet_kernel._original
    dtype = getattr(mx, a.dtype)
    mx.random.seed(0)
    for t in a.tokens:
        args = inputs(a.batch, t, a.heads[0], a.heads[1], a.dims[0], a.dims[1], dtype)
        mask = padding(a.batch, t)
        repeat = 50 if t <= 16 else 3
        ops_ms, ops_mb, (y0, s0) = timed(lambda *x, m=mask: original(*x, m), args, repeat)
        ker_ms, ker_mb, (y1, s1) = timed(lambda q, k, v, g, b, s, m=mask: deltanet_kernel.recurrence(q, k, v, g, b, s, m), args, repeat)
        dy, ds, y_scale = differences(y0, s0, y1, s1, mask)
        print(json.dumps({"tokens": t, "batch": a.batch, "ops_ms": round(ops_ms, 3), "kernel_ms": round(ker_ms, 3),
                          "speedup": round(ops_ms / max(ker_ms, 1e-9), 1), "ops_peak_mb": round(ops_mb, 1),
                          "kernel_peak_mb": round(ker_mb, 1), "max_abs_y": dy, "max_abs_state": ds,
                          "y_scale": y_scale, "state_scale": mx.abs(s0).max().item()}))


if __name__ == "__main__":
    main()
