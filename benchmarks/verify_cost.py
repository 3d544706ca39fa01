"""What a T-token forward costs against a one-token step, on this backend (issue 24).

Speculative decoding wins only when a pass over [last token, d1 .. dk] costs little more
than one decode step. On the H200 (session 15) a verify pass of 3 positions cost ~3x a
plain step with every expert pooled, so speculation lost (0.82x). This script asks whether
that is the model's compute on MLX's backend or moestream's pass: mlx-lm's own model, every
expert resident, timed per pass for T = 1..4 positions, and per module kind (a DeltaNet
mixer, full attention, the MoE block) at the same T.

    python benchmarks/verify_cost.py CONTAINER [--reps 20] [--json out.json]

Prints one JSON line: median ms per pass and per module call, by T.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.refs import load_resident  # noqa: E402
from qpack.reader import Container  # noqa: E402


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):  # kernels compile for this shape on first use
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _at(model: Any, t: int, reps: int, linear: int | None, full: int | None) -> dict[str, float]:
    """Median ms of a T-token pass and of each module kind's call at T tokens."""
    layers = model.layers
    hidden = layers[0].input_layernorm.weight.shape[0]
    cache = model.make_cache()
    mx.eval(model(mx.array([[1 + i for i in range(16)]]), cache=cache))
    tokens = mx.array([[7 + i for i in range(t)]])
    # The cache grows by t a call: 16 + t * (reps + 3) positions, small beside the work.
    row = {"pass_ms": median_ms(lambda: model(tokens, cache=cache), reps)}
    x = mx.random.normal((1, t, hidden)).astype(mx.bfloat16)
    if linear is not None:
        lin, lc = layers[linear], model.make_cache()[linear]
        row["linear_mixer_ms"] = median_ms(
            lambda: lin.linear_attn(lin.input_layernorm(x), None, lc), reps)
    if full is not None:
        att, fc = layers[full], model.make_cache()[full]
        mask = "causal" if t > 1 else None
        row["attention_ms"] = median_ms(
            lambda: att.self_attn(att.input_layernorm(x), mask, fc), reps)
    moe = layers[linear if linear is not None else 0]
    row["moe_ms"] = median_ms(lambda: moe.mlp(x), reps)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-t", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    with Container.open(args.container, verify="off") as c:
        model = load_resident(c)
    layers = model.layers
    linear = next((i for i, b in enumerate(layers) if hasattr(b, "linear_attn")), None)
    full = next((i for i, b in enumerate(layers) if hasattr(b, "self_attn")), None)
    out: dict[str, Any] = {"backend": str(mx.default_device()), "layers": len(layers),
                           "pass_ms": {}, "linear_mixer_ms": {}, "attention_ms": {},
                           "moe_ms": {}}
    for t in range(1, args.max_t + 1):
        row = _at(model, t, args.reps, linear, full)
        for k, v in row.items():
            out[k][t] = v
        print(json.dumps({"t": t, **row}), flush=True)
    line = json.dumps(out)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
