"""Whether `gather_qmm` finds an expert right in a pool array past 2^31 elements.

    python benchmarks/gather_qmm_index_probe.py [--slots 10240]

A pool-like weight array at the 35B's expert dimensions (4-bit, [slots, 512, 2048]:
2^20 elements a slot, 5.4 GB at 10,240 slots). Prefill-like calls (16 tokens x 8
experts, sorted and not) with slots drawn from a window starting at `lo`, against the
same experts copied into an array of their own; then the same slots through a bank's
slice of the array with indices relative to its start (actors/pool/banks.py), the
engine's way round it. One JSON line per call: the largest |difference|. Session 23 on
the H200 (MLX 0.32.4 CUDA): 0 from slots below 2,000, ~6.8 from windows past 4,096, so
every expert of the 35B pooled in one array gave wrong outputs.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

N, K, TOP_K, TOKENS = 512, 2048, 8, 16


def _call(x: mx.array, w: tuple[mx.array, mx.array, mx.array], idx: mx.array, sort: bool) -> mx.array:
    xx, ii, inv = x, idx, None
    if sort:
        flat = idx.flatten()
        order = mx.argsort(flat)
        inv = mx.argsort(order)
        xx, ii = x.flatten(0, -3)[order // TOP_K], flat[order]
    out = mx.gather_qmm(xx, *w, rhs_indices=ii, transpose=True, group_size=64, bits=4, sorted_indices=sort)
    return out if inv is None else mx.unflatten(out[inv], 0, idx.shape)


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def main(slots: int) -> None:
    w = mx.random.randint(0, 2**31 - 1, (slots, N, K // 8)).astype(mx.uint32)
    scales = (mx.random.uniform(shape=(slots, N, K // 64)) * 0.01).astype(mx.bfloat16)
    biases = (mx.random.uniform(shape=(slots, N, K // 64)) * -0.01).astype(mx.bfloat16)
    pool = (w, scales, biases)
    mx.eval(*pool)
    rng = np.random.default_rng(1)
    for lo in range(0, slots - 2000, 2000):
        chosen = rng.choice(np.arange(lo, lo + 2000), 128, replace=False).astype(np.int32)
        ids = np.stack([rng.choice(128, TOP_K, replace=False) for _ in range(TOKENS)])[None].astype(np.int32)
        x = mx.random.normal((1, TOKENS, 1, 1, K)).astype(mx.bfloat16)
        alone = tuple(mx.contiguous(t[mx.array(chosen)]) for t in pool)
        bank = tuple(t[lo:lo + 2000] for t in pool)
        for sort in (False, True):
            ref = _call(x, alone, mx.array(ids), sort)  # type: ignore[arg-type]
            whole = _call(x, pool, mx.array(chosen[ids]), sort)
            banked = _call(x, bank, mx.array(chosen[ids] - lo), sort)  # type: ignore[arg-type]
            print(json.dumps({"lo": lo, "sorted": sort, "whole_array": _diff(whole, ref),
                              "bank_slice": _diff(banked, ref)}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=10240)
    main(ap.parse_args().slots)
