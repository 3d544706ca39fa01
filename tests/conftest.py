"""Shared fixtures. `synth_checkpoint` writes tiny synthetic checkpoints once per session."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# The package is used from the checkout (not installed) when tests run as `.venv/bin/pytest`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpack.synth.checkpoint import synthesize  # noqa: E402


@pytest.fixture(scope="session")
def synth_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `synth_checkpoint(family: str, *, dtype="float32", bits=None, layout="hub") -> Path`.

    Returns the directory of the `tiny` preset of `family` ("qwen3_next" or "qwen3_5_moe"),
    seed 0, written once per argument combination per test session. `bits` 4 or 8 gives the
    MLX-quantized layout (what `mlx_lm.convert -q` writes); `layout="per-expert"` gives
    transformers' text-only Qwen3.5 MoE layout; `variant="thinking"` Qwen3-Next's Thinking
    template and generation_config; `mode` (mxfp4, nvfp4, mxfp8) and `recipe` (mixed_3_6, ...)
    what mlx_lm.convert --q-mode / --quant-predicate write. Treat the directory as read-only.
    """
    made: dict[tuple[str, str, int | None, str, str | None], Path] = {}

    def make(family: str, *, dtype: str = "float32", bits: int | None = None,
             layout: str = "hub", variant: str | None = None, mode: str = "affine",
             recipe: str | None = None) -> Path:
        key = (family, dtype, bits, layout, variant, mode, recipe)
        if key not in made:
            out = tmp_path_factory.mktemp(f"synth-{family}-{dtype}-{bits}-{layout}-{variant}-{mode}-{recipe}")
            made[key] = synthesize(out, family, "tiny", dtype=dtype, bits=bits, layout=layout,
                                   progress=False, variant=variant, mode=mode, recipe=recipe)
        return made[key]

    return make
