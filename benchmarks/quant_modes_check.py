"""Which MLX quantization modes `gather_qmm` runs on this machine's default device.

For each (mode, bits, group size) that qpack.quantize.MODES lists: quantize random expert
weights with mx.quantize, run gather_qmm over expert indices (unsorted and sorted, float32
and bfloat16 activations) and compare with a matmul over the dequantized weights. Prints
one line per case and writes JSON to $OUT/quant_modes.json (or ./quant_modes.json).

    python3 benchmarks/quant_modes_check.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qpack.quantize import MODES  # noqa: E402


def check(mode: str, bits: int, gs: int, dtype: mx.Dtype, sort: bool) -> dict:
    mx.random.seed(0)
    experts, out_dim, in_dim, tokens, k = 8, 256, 512, 16, 4
    w = (mx.random.normal((experts, out_dim, in_dim)) * 0.05).astype(dtype)
    parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    wq, scales = parts[0], parts[1]
    biases = parts[2] if len(parts) > 2 else None
    deq = mx.dequantize(wq, scales, biases, group_size=gs, bits=bits, mode=mode).astype(mx.float32)
    x = mx.random.normal((tokens, 1, 1, in_dim)).astype(dtype)
    idx = mx.random.randint(0, experts, (tokens, k)).astype(mx.uint32)
    if sort:
        flat = idx.flatten()
        order = mx.argsort(flat)
        xs, ids = x.flatten(0, -3)[order // k], flat[order]
    else:
        xs, ids = x, idx
    got = mx.gather_qmm(xs, wq, scales, biases, rhs_indices=ids, transpose=True, group_size=gs,
                        bits=bits, mode=mode, sorted_indices=sort).astype(mx.float32)
    want = mx.gather_mm(xs.astype(mx.float32), deq.swapaxes(-1, -2), rhs_indices=ids,
                        sorted_indices=sort)
    mx.eval(got, want)
    err = float(mx.abs(got - want).max().item())
    scale = float(mx.abs(want).max().item())
    rel = err / max(scale, 1e-9)
    # float32: the same numbers, up to summation order; bfloat16 activations: the kernel's
    # own rounding (~5% at worst on the CPU) — what "ok" catches is a wrong or refused kernel.
    return {"mode": mode, "bits": bits, "group_size": gs, "dtype": str(dtype), "sorted": sort,
            "max_abs_err": err, "rel_err": rel, "ok": rel < (1e-3 if dtype == mx.float32 else 0.1)}


def main() -> int:
    device = str(mx.default_device())
    rows = []
    for mode, (bits_list, sizes) in MODES.items():
        for bits in bits_list:
            for gs in sizes:
                for dtype in (mx.float32, mx.bfloat16):
                    for sort in (False, True):
                        try:
                            row = check(mode, bits, gs, dtype, sort)
                        except Exception as exc:  # noqa: BLE001 - a refusal is the answer
                            row = {"mode": mode, "bits": bits, "group_size": gs, "dtype": str(dtype),
                                   "sorted": sort, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "quant_modes.json"
    out.write_text(json.dumps({"device": device, "mlx": mx.__version__, "cases": rows}, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"{device} mlx {mx.__version__}: {len(rows) - len(bad)}/{len(rows)} cases ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
