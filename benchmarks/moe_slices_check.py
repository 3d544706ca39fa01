"""Whether a prompt chunk's MoE halves in slices give the whole chunk's bits on this
backend (docs/memory.md, session 18): one chunk's last logits, whole and sliced.

    python benchmarks/moe_slices_check.py C.qpack [TOKENS] [SLICE]
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import trio


async def main(path: str, tokens: int, piece: int) -> None:
    from pipeline.bench.spec import prompt_ids
    from pipeline.config.loading import config_from_dict
    from pipeline.engine import open_engine

    cfg = config_from_dict({"model": {"path": path, "verify": "off"}, "pool": {"budget_mb": 1024},
                            "compute": {"prefill_chunk": tokens}}, source="<moe_slices_check>")
    async with open_engine(cfg) as engine:
        core = engine._core
        prompt = prompt_ids(tokens, engine.facts.vocab_size, 0)
        out = {}
        for name, size in (("whole", 1 << 30), ("sliced", piece or core.model.moe_slice_tokens)):
            core.model.moe_slice_tokens = size
            async with core.lock:
                logits = await core.compute.forward(prompt, core.model.make_cache(), "prefill")
                out[name] = await core.worker.run(lambda x=logits: np.array(x.astype(mx.float32)))
        same = bool(np.array_equal(out["whole"], out["sliced"]))
        print("moe_slices_check", {"tokens": tokens, "slice": size, "bitwise": same,
                                   "max_abs": float(np.abs(out["whole"] - out["sliced"]).max())})


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1024,
             int(sys.argv[3]) if len(sys.argv) > 3 else 0)
