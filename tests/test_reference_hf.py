"""HF transformers (PyTorch, fp32) on the same tiny fp32 checkpoints: a second, independent
reference for the streamed forward's logits (the first is mlx-lm, in test_forward.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_forward import DirectForward

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]

# (family, checkpoint layout, transformers class). Qwen3.5 MoE's hub checkpoint is the
# multimodal layout (`model.language_model.*`), which is ConditionalGeneration's; the
# text-only per-expert layout is what Qwen3_5MoeForCausalLM loads.
CASES = [
    ("qwen3_next", "hub", "Qwen3NextForCausalLM"),
    ("qwen3_5_moe", "hub", "Qwen3_5MoeForConditionalGeneration"),
    ("qwen3_5_moe", "per-expert", "Qwen3_5MoeForCausalLM"),
]


def _hf_logits(src, class_name: str, tokens: list[int]) -> np.ndarray:
    # Imported here, not at module level: collecting this file made every xdist worker
    # import torch (~1.5 s of CPU), the one that never runs these tests too.
    torch = pytest.importorskip("torch")
    import transformers

    cls = getattr(transformers, class_name)
    model = cls.from_pretrained(src, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


@pytest.mark.parametrize(("family", "layout", "class_name"), CASES)
def test_logits_match_transformers(synth_checkpoint, packed, family, layout, class_name):
    src = synth_checkpoint(family, dtype="float32", layout=layout)
    qpack = packed(src, bits=16)
    ours = DirectForward(qpack)
    got = np.array(ours.forward(PROMPT, ours.make_cache())[0])
    ours.close()
    want = _hf_logits(src, class_name, PROMPT)
    assert got.shape == want.shape == (len(PROMPT), want.shape[-1])
    diff = float(np.max(np.abs(got - want)))
    assert diff <= 1e-4, f"max |moestream - transformers| = {diff}"
