"""Where a process's peak memory went: the issue-25 table, for every bench case.

    process (Python + libraries) | device runtime | tokenizer | dense core | expert pool | model state |
    state copies | staging buffers | MLX temporaries (MLX's peak above dense + pool + state
    + copies) | other

The engine marks RSS as it opens (`OpenMarks`: before anything, once MLX's device runtime
is up, after the tokenizer);
the rest are sizes it knows (manifest, pool, reader, the prefix cache's state copies:
a prompt's checkpoint is as large as its live state, 86 MiB at 1024 tokens of the 35B)
or MLX's own peak. "other" is
what RSS held at its peak beyond all of those (allocator slack, library pages, page
cache of mapped files); on a GPU MLX's memory is outside RSS and only "MLX peak" and
the device-side rows apply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from pipeline.engine_core import EngineCore

MIB = 2**20


class MemoryBreakdown(msgspec.Struct, frozen=True):
    peak_rss_mb: float
    mlx_peak_mb: float
    process_mb: float
    tokenizer_mb: float
    dense_mb: float
    pool_mb: float
    state_mb: float
    staging_mb: float
    temporaries_mb: float
    other_mb: float
    budget_mb: float | None = None  # memory.budget_mb when set
    copies_mb: float = 0.0  # the prefix cache's state copies beside the live state
    runtime_mb: float = 0.0  # the device's runtime up, before any weight (`runtime_up`)


def breakdown(engine: EngineCore, peak_rss_mb: float, mlx_peak_mb: float, tokens: int,
              rows: int = 1) -> MemoryBreakdown:
    """The split of this process's peak; `tokens` per sequence, `rows` sequences at once."""
    marks = engine.memory_marks
    process = marks.start_mb if marks else 0.0
    tokenizer = marks.tokenizer_mb if marks else 0.0
    runtime = marks.runtime_mb if marks else 0.0
    dense = engine.facts.dense_bytes / MIB  # held: less a token embedding on file
    experts = engine.mtp.experts if engine.mtp is not None else None  # the MTP head's pool
    pool = (engine.storage.nbytes + (experts.nbytes if experts is not None else 0)) / MIB
    state = rows * engine.model.state_bytes(tokens) / MIB
    # A generation's end state goes into the prefix cache itself (`put`, not a copy): what
    # it holds beyond that was copied (the checkpoint before the last prompt token).
    copies = max(engine.prefix_cache.bytes / MIB - state, 0.0)
    staging = engine.router.reader.staging_bytes / MIB
    temporaries = max(mlx_peak_mb - dense - pool - state - copies, 0.0)
    known = process + runtime + tokenizer + dense + pool + state + copies + staging + temporaries
    plan = engine.memory_plan
    return MemoryBreakdown(
        peak_rss_mb=peak_rss_mb, mlx_peak_mb=mlx_peak_mb, process_mb=process,
        tokenizer_mb=tokenizer, dense_mb=dense, pool_mb=pool, state_mb=state,
        staging_mb=staging, temporaries_mb=temporaries, other_mb=peak_rss_mb - known,
        budget_mb=plan.budget_mb if plan else None, copies_mb=copies, runtime_mb=runtime)


COLUMNS = (("peak RSS", "peak_rss_mb"), ("Python + libs", "process_mb"), ("runtime", "runtime_mb"),
           ("tokenizer", "tokenizer_mb"), ("dense", "dense_mb"), ("pool", "pool_mb"),
           ("state", "state_mb"), ("copies", "copies_mb"), ("staging", "staging_mb"),
           ("MLX temps", "temporaries_mb"),
           ("other", "other_mb"), ("budget", "budget_mb"))


def memory_table(report: dict[str, Any]):  # -> rich.table.Table | None
    """Every bench case's peak, split (MiB); None when no case has the split."""
    from rich.table import Table

    rows = [r for r in report["results"] if not r.get("error") and r.get("memory")]
    if not rows:
        return None
    table = Table(title="memory at the peak (MiB): docs/memory.md")
    table.add_column("case")
    for title, _ in COLUMNS:
        table.add_column(title, justify="right")
    for r in rows:
        m = r["memory"]
        table.add_row(r["name"], *("-" if m.get(k) is None else f"{m[k]:,.0f}" for _, k in COLUMNS))
    return table
