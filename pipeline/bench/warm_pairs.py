"""`warm-all` against resident mlx-lm, in alternate runs of one process.

The warm-all target (every expert pooled >= 0.9x resident mlx-lm, issue 31) was measured
as one engine run, the engine closed, then one resident run: on the H200 the ratio moved
0.48-1.21 between leases, and within one process (session 26: 19.80 against 41.32 tok/s),
by more than any host change moved it. Here the engine stays open after its measured
generation, mlx-lm's model is loaded once beside it, and `PAIRS` (resident run, engine run)
pairs alternate: the ratio is the median of the pairs', so a drift of the machine's speed
during the case (another tenant, the GPU's clocks) falls on both runs of a pair, and one
slowed run moves one pair only (the best engine run over the best resident one is reported
beside it: a shared machine's noise only ever slows a run down). Both models are then held
at once: only where the memory left holds the resident one too (`fits`); elsewhere the
resident model is measured after the engine closes, as before.

The resident model runs on the calling thread (trio's), the engine on its own MLX thread:
their arrays never meet (MLX streams are per thread).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import msgspec

PAIRS = 5
RESERVE_BYTES = 1 << 30  # left free beside both models (activations, the allocator's slack)


class Pairs(msgspec.Struct, frozen=True):
    engine_tok_s: list[float]  # the engine's decode, one per pair (after the resident run)
    resident_tok_s: list[float]

    @property
    def ratio(self) -> float:
        """The median of the pairs' engine / resident ratios (0.0 without a pair)."""
        ratios = [e / r for e, r in zip(self.engine_tok_s, self.resident_tok_s, strict=True) if r > 0]
        return statistics.median(ratios) if ratios else 0.0

    @property
    def best_ratio(self) -> float:
        """The best engine run over the best resident run (0.0 without a pair)."""
        best = max(self.resident_tok_s, default=0.0)
        return max(self.engine_tok_s, default=0.0) / best if best > 0 else 0.0


def fits(model: Path) -> bool:
    """Whether mlx-lm's resident copy of `model` fits beside the open engine's pool."""
    import mlx.core as mx
    import psutil

    from actors.cuda_driver import gpu_memory_bytes
    from pipeline.bench.refs import resident_bytes
    from qpack.reader import Container

    with Container.open(model, verify="off") as c:
        need = resident_bytes(c) + RESERVE_BYTES
    if mx.cuda.is_available():
        return gpu_memory_bytes() - mx.get_active_memory() >= need
    return int(psutil.virtual_memory().available) >= need


async def alternate(engine: Any, model: Path, prompt: list[int], params: Any, seed: int,
                    pairs: int = PAIRS) -> Pairs:
    """`pairs` (resident, engine) runs of `prompt` at `params.max_tokens`, each engine run
    with its own seed (every expert pooled: nothing is read, the same work)."""
    from contextlib import aclosing

    from pipeline.bench.refs import decode_resident, resident_model
    from pipeline.events import Done

    resident, _, _ = resident_model(model)
    engine_tok_s: list[float] = []
    resident_tok_s: list[float] = []
    for i in range(pairs):
        resident_tok_s.append(decode_resident(resident, prompt, params.max_tokens, seed + i).decode_tok_s)
        run = msgspec.structs.replace(params, seed=seed + i)
        async with aclosing(engine.generate(prompt, run)) as it:
            async for event in it:
                if isinstance(event, Done):
                    engine_tok_s.append(event.stats.decode_tok_s)
    del resident
    return Pairs(engine_tok_s, resident_tok_s)


def wants_resident(case: Any) -> bool:
    """The case compares itself with resident mlx-lm: warm-all without speculation."""
    return bool(case.warm_all) and case.config.get("compute", {}).get("speculative", "off") == "off"


async def paired(engine: Any, case: Any, prompt: list[int], params: Any) -> Pairs | None:
    """`alternate` after a warm-all case's measured generation, where both models fit."""
    if not wants_resident(case) or not fits(Path(case.model)):
        return None
    return await alternate(engine, Path(case.model), prompt, params, case.seed + 1)


def pair_fields(pairs: Pairs | None) -> dict[str, Any]:
    """Result fields: the pairs' runs and the resident model's median."""
    if pairs is None:
        return {}
    return {"paired_engine_tok_s": pairs.engine_tok_s, "paired_resident_tok_s": pairs.resident_tok_s,
            "resident_decode_tok_s": statistics.median(pairs.resident_tok_s)}
