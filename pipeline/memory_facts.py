"""What an engine records about its memory as it opens: the plan of a total budget, and
RSS marks. Leaf types, so the engine's core can hold them (pipeline/memory_budget.py
makes the plan, pipeline/memory_breakdown.py reads the marks)."""

from __future__ import annotations

import msgspec

from pipeline.resident_map import current_rss_mb


class MemoryPlan(msgspec.Struct, frozen=True):
    """Where a total budget goes, in MiB: measured parts, reserves, and the pool (the rest)."""

    budget_mb: float
    process_mb: float  # RSS when the pool was sized: Python, libraries, the tokenizer
    dense_mb: float  # the dense core's weights (manifest: what MLX holds once loaded)
    state_mb: float  # KV + DeltaNet state of the sequences decoding at once
    staging_mb: float  # the reader's staging buffers
    temporaries_mb: float  # MLX's temporaries above dense + pool + state, and its cache
    pool_mb: float
    slots: int

    def line(self) -> str:
        return (f"budget {self.budget_mb:,.0f} MiB = process with tokenizer {self.process_mb:,.0f}"
                f" + dense core {self.dense_mb:,.0f} + state {self.state_mb:,.0f} + staging "
                f"{self.staging_mb:,.0f} + temporaries {self.temporaries_mb:,.0f} + expert pool "
                f"{self.pool_mb:,.0f} ({self.slots} slots)")


class OpenMarks:
    """RSS at the points of an engine's open that split the process from its parts."""

    def __init__(self) -> None:
        self.start_mb = current_rss_mb()
        self.runtime_mb = 0.0  # the device's runtime up (`runtime_up`), before any weight
        self.tokenizer_mb = 0.0

    def after_runtime(self) -> None:
        self.runtime_mb = max(current_rss_mb() - self.start_mb, 0.0)

    def after_tokenizer(self) -> None:
        self.tokenizer_mb = max(current_rss_mb() - self.start_mb - self.runtime_mb, 0.0)


def runtime_up() -> bool:
    """MLX's device runtime brought up (on CUDA its stream and allocator; MLX's import
    already made the context: +20-22 MiB here on an H100, session 39) so RSS marks split
    it from the engine's parts, the issue-25 baseline's "before any weight"; True where
    MLX runs on the CPU. Runs on the MLX thread."""
    import mlx.core as mx

    mx.eval(mx.zeros(1))
    return bool(mx.default_device() == mx.cpu)
