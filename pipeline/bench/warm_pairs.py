"""Every expert pooled, against what it is compared with, in alternate runs of one process:
`warm-all` against resident mlx-lm, a `warm-spec-*` case against plain decode.

The warm-all target (every expert pooled >= 0.9x resident mlx-lm, issue 31) was measured
as one engine run, the engine closed, then one resident run: on the H200 the ratio moved
0.48-1.21 between leases, and within one process (session 26: 19.80 against 41.32 tok/s),
by more than any host change moved it. Here the engine stays open after its measured
generation, mlx-lm's model is loaded once beside it, and `PAIRS` pairs of runs alternate
(resident then engine, every other pair engine then resident: `_order`): the ratio is the
median of the pairs', so a drift of the machine's speed during the case (another tenant,
the GPU's clocks) falls on both runs of a pair, and one slowed run moves one pair only (the best engine run over the best resident one is reported
beside it: a shared machine's noise only ever slows a run down). Both models are then held
at once: only where the memory left holds the resident one too (`fits`); elsewhere the
resident model is measured after the engine closes, as before.

The resident model runs on the calling thread (trio's), the engine on its own MLX thread:
their arrays never meet (MLX streams are per thread).

A `warm-spec-*` case's "x plain" was its one run over `warm-all`'s one run, each in a
process of its own: on the H200 a 32-token run of either moved +-15 % (session 29: plain
25.3-30.8 tok/s in four runs of one lease, `auto` with a head that drafts nothing 0.86-1.06x
it). Here the speculating engine, after its measured generation, alternates `PAIRS` pairs
of plain and speculative runs (in `_order`) of the same prompt and seed (a request's
`speculative = "off"` decodes plainly in the same engine, the same pool, the same compiled kernels; the emulated drafts
match the seed's tokens), and "x plain" is the median of the pairs' ratios. `auto`'s policy
is the engine's and learns across the runs, as a server's does.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import msgspec

PAIRS = 5
RESERVE_BYTES = 1 << 30  # left free beside both models (activations, the allocator's slack)


class Pairs(msgspec.Struct, frozen=True):
    engine_tok_s: list[float]  # the engine's decode, one per pair (after the other run)
    resident_tok_s: list[float]  # the run it is compared with: resident mlx-lm, or plain decode
    against: str = "resident"  # "resident" (warm-all) or "plain" (a warm-spec case)

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
    from pipeline.bench.refs import decode_resident, resident_model

    resident, _, _ = resident_model(model)
    engine_tok_s: list[float] = []
    resident_tok_s: list[float] = []
    for i in range(pairs):
        for side in _order(i):
            if side == "reference":
                resident_tok_s.append(decode_resident(resident, prompt, params.max_tokens, seed + i).decode_tok_s)
            else:
                run = msgspec.structs.replace(params, seed=seed + i)
                engine_tok_s.append((await finished(engine, prompt, run)).stats.decode_tok_s)
    del resident
    return Pairs(engine_tok_s, resident_tok_s)


def _order(pair: int) -> tuple[str, str]:
    """Which run of a pair goes first: the reference, then the measured side, every other
    pair the other way round (a bias of the second run of a pair, e.g. the first run's
    memory or clocks left behind, falls on each side alike)."""
    return ("reference", "measured") if pair % 2 == 0 else ("measured", "reference")


async def against_plain(engine: Any, prompt: list[int], params: Any, pairs: int = PAIRS) -> Pairs:
    """`pairs` (plain, speculative) runs of `prompt` with `params` (the measured run's seed)."""
    plain = msgspec.structs.replace(params, speculative="off")
    spec_tok_s: list[float] = []
    plain_tok_s: list[float] = []
    for i in range(pairs):
        for side in _order(i):
            if side == "reference":
                plain_tok_s.append((await finished(engine, prompt, plain)).stats.decode_tok_s)
            else:
                spec_tok_s.append((await finished(engine, prompt, params)).stats.decode_tok_s)
    return Pairs(spec_tok_s, plain_tok_s, against="plain")


async def finished(engine: Any, prompt: list[int], params: Any) -> Any:
    """One generation run to its end: its `Done` event (the bench's cases use it too)."""
    from contextlib import aclosing

    from pipeline.events import Done

    async with aclosing(engine.generate(prompt, params)) as it:
        async for event in it:
            if isinstance(event, Done):
                return event
    raise RuntimeError("a generation ended without its Done event")


def _speculates(case: Any) -> bool:
    return case.config.get("compute", {}).get("speculative", "off") != "off"


def wants_resident(case: Any) -> bool:
    """The case compares itself with resident mlx-lm: warm-all without speculation."""
    return bool(case.warm_all) and not _speculates(case)


def wants_plain(case: Any) -> bool:
    """The case speculates with every expert pooled (`warm-spec-*`): compared with plain."""
    return bool(case.warm_all) and _speculates(case)


async def paired(engine: Any, case: Any, prompt: list[int], params: Any) -> Pairs | None:
    """After a warm case's measured generation: `alternate` (warm-all, where both models
    fit) or `against_plain` (warm-spec-*); None for any other case."""
    if wants_plain(case):
        return await against_plain(engine, prompt, params)
    if not wants_resident(case) or not fits(Path(case.model)):
        return None
    return await alternate(engine, Path(case.model), prompt, params, case.seed + 1)


def pair_fields(pairs: Pairs | None) -> dict[str, Any]:
    """Result fields: the pairs' runs (and the resident model's median)."""
    if pairs is None:
        return {}
    if pairs.against == "plain":
        return {"paired_spec_tok_s": pairs.engine_tok_s, "paired_plain_tok_s": pairs.resident_tok_s}
    return {"paired_engine_tok_s": pairs.engine_tok_s, "paired_resident_tok_s": pairs.resident_tok_s,
            "resident_decode_tok_s": statistics.median(pairs.resident_tok_s)}
