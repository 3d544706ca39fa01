"""Chat variants of a family: the chat template and generation_config.json that go with them.

The weights do not depend on the variant; Qwen3-Next ships an Instruct and a Thinking
model of the same shapes, Qwen3.5/3.6 one hybrid model that thinks unless told not to.
"""

from __future__ import annotations

from typing import Any

from qpack.synth.presets import (
    QWEN3_5_EOS,
    QWEN3_5_IM_END,
    QWEN3_NEXT_BOS,
    QWEN3_NEXT_EOS,
    ModelDims,
)

# Chat variants of each family (the first is the default): Qwen3-Next ships an Instruct and
# a Thinking model (same weights' shapes, other template and sampling defaults); Qwen3.5/3.6
# are hybrids that think unless the template's `enable_thinking` is false.
VARIANTS: dict[str, tuple[str, ...]] = {"qwen3_next": ("instruct", "thinking"),
                                        "qwen3_5_moe": ("hybrid",)}


def check_variant(family: str, variant: str | None) -> str:
    """The variant to write (the family's default for None); one clear line if unknown."""
    allowed = VARIANTS[family]
    if variant is None:
        return allowed[0]
    if variant not in allowed:
        raise ValueError(f"variant {variant!r} does not exist for {family}: expected one of {list(allowed)}")
    return variant


def generation_config(dims: ModelDims, variant: str | None = None) -> dict[str, Any]:
    """generation_config.json as the hub ships it: eos ids (<|im_end|> and <|endoftext|>)
    and the sampling the model was tuned for (Instruct 0.7/0.8/20, Thinking 0.6/0.95/20)."""
    variant = check_variant(dims.family, variant)
    if dims.family == "qwen3_next" and variant == "thinking":
        return {
            "bos_token_id": QWEN3_NEXT_BOS,
            "do_sample": True,
            "eos_token_id": [QWEN3_NEXT_EOS, QWEN3_NEXT_BOS],
            "pad_token_id": QWEN3_NEXT_BOS,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "4.57.0.dev0",
        }
    if dims.family == "qwen3_next":
        return {
            "bos_token_id": QWEN3_NEXT_BOS,
            "do_sample": True,
            "eos_token_id": [QWEN3_NEXT_EOS, QWEN3_NEXT_BOS],
            "pad_token_id": QWEN3_NEXT_BOS,
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "transformers_version": "4.57.0.dev0",
        }
    return {
        "bos_token_id": QWEN3_5_EOS,
        "do_sample": True,
        "eos_token_id": [QWEN3_5_IM_END, QWEN3_5_EOS],
        "pad_token_id": QWEN3_5_EOS,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.57.1",
    }
