"""`moestream info C --memory-mb N`: the pool a total budget gives, and the hits to expect.

The same plan an engine makes at open (`memory_budget.plan_memory`), with the parts it
measures measured here the same way: this process's RSS once the engine's modules and
the container's tokenizer are loaded, the manifest's dense core as an engine holds it
(less a token embedding left on file, plus a widened lm_head), the reader's staging for
the disk threads it would choose. The expected hit rate is the pool advice's (a replay of
calibrated routing) at that pool size, interpolated between its rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import msgspec

from pipeline.memory_facts import MemoryPlan


class BudgetInfo(msgspec.Struct, frozen=True):
    plan: MemoryPlan
    hit_expected: float | None  # decode hits with next-gate prefetch (None: no advice rows)
    note: str


def hit_at(rows: list[dict[str, Any]], per_layer: float) -> float | None:
    """The default setting's hit rate with `per_layer` slots per MoE layer, log-linear
    between the advice's rows (in slots, not MiB: on the CPU the pool's slots are wider
    than the container's stride); a layer's whole expert set hits every time."""
    if not rows:
        return None
    first, last = rows[0], rows[-1]
    if per_layer <= first["slots_per_layer"]:
        return first["hit_default"] * per_layer / first["slots_per_layer"]
    points = [(r["slots_per_layer"], r["hit_default"]) for r in rows]
    points.append((round(last["slots_per_layer"] / last["share"]), 1.0))
    for (s0, h0), (s1, h1) in zip(points, points[1:], strict=False):
        if per_layer <= s1:
            return h0 + math.log(per_layer / s0) / math.log(s1 / s0) * (h1 - h0)
    return 1.0


def budget_info(path: Path, memory_mb: int | Literal["auto"], advice: dict[str, Any] | None) -> BudgetInfo:
    """Raises PoolBudgetError (one line with the numbers) when the budget is too small."""
    import mlx.core as mx

    import pipeline.engine  # noqa: F401 - the modules an engine has loaded when it sizes its pool
    from actors.pool.layout import PoolLayout, widen_for
    from actors.queue_depth import choose_depth
    from pipeline.config.schema import ComputeConfig, MemoryConfig
    from pipeline.engine_sizing import smallest_workable_slots
    from pipeline.memory_budget import plan_memory
    from pipeline.models.dense import held_bytes
    from pipeline.models.file_embedding import wants_file
    from pipeline.models.streamed import activation_dtype
    from pipeline.resident_map import current_rss_mb
    from pipeline.tokenizer import load_tokenizer
    from qpack.reader import Container

    with Container.open(path, verify="off") as c:
        m = c.manifest
        on_file = wants_file(MemoryConfig().embedding, mx.default_device() == mx.cpu)
        dtype = activation_dtype(ComputeConfig().dtype)
        load_tokenizer(c.tokenizer_dir())
        layout = PoolLayout.of(m.layers, widen_for(dtype))
        plan = plan_memory(
            MemoryConfig(budget_mb=memory_mb), process_bytes=int(current_rss_mb() * 2**20),
            dense_bytes=held_bytes(c.dense_path, m.dense_bytes, embedding_on_file=on_file,
                                   head_dtype=dtype), slot_nbytes=layout.slot_nbytes, stride=m.max_stride,
            readers=choose_depth(c).depth,
            need_slots=smallest_workable_slots(m.num_experts, m.top_k, ComputeConfig().prefill_chunk),
            max_slots=m.num_experts * len(m.layers))
    hit = hit_at(advice["rows"], plan.slots / len(m.layers)) if advice else None
    return BudgetInfo(plan=plan, hit_expected=None if hit is None else round(hit, 3),
                      note="what an engine opened with --memory-mb would plan on this machine; "
                           "the hit rate is the pool advice's at that pool size (trained-like "
                           "routing; a random-weight container hits about slots / experts)")
