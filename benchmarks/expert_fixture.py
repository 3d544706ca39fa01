"""What the micro-benchmarks share: a preset's expert layout and random expert blobs.

A full-size preset names its family; any other (tiny, demo, cpu-bench) is taken in
`family`. The blobs are whole strides, as a reader's staging buffer holds them.
"""

from __future__ import annotations

import numpy as np

from qpack.spec import ExpertFormat
from qpack.synth.bench_container import expert_layout
from qpack.synth.presets import FULL_SIZE, get_preset


def random_experts(preset: str, count: int, family: str = "qwen3_5_moe",
                   seed: int = 0) -> tuple[ExpertFormat, list[np.ndarray]]:
    """The preset's 4-bit expert format and `count` random blobs of its stride."""
    fmt, stride = expert_layout(get_preset(None if preset in FULL_SIZE else family, preset), 4, 64)
    rng = np.random.default_rng(seed)
    return fmt, [np.frombuffer(rng.bytes(stride), dtype=np.uint8).copy() for _ in range(count)]
