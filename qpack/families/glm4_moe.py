"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (model_type `glm4_moe`, zai-org), as mlx_lm.models.glm4_moe
and transformers' Glm4MoeForCausalLM read them.

Full attention with q/k/v biases and partial rotary (half the head), q/k RMSNorm only on
GLM-4.5/4.6 (`use_qk_norm`); the first `first_k_dense_replace` layers have a dense SwiGLU
MLP, the rest route over `n_routed_experts` with a sigmoid router whose choice adds the
per-expert `e_score_correction_bias` (float32) and keeps the best `topk_group` of `n_group`
groups, weights renormalized and scaled by `routed_scaling_factor`, plus `n_shared_experts`
shared experts (`mlp.shared_experts.*`, kept dense). The hub layout is flat and per-expert
(`model.layers.{i}.mlp.experts.{e}.{proj}.weight`); its MTP layer is one more decoder layer,
`model.layers.{num_hidden_layers}.*`, which mlx-lm's sanitize drops. Standard RMSNorm
weights. Config keys follow the hub's config.json of zai-org/GLM-4.5-Air and GLM-4.5.
"""

from __future__ import annotations

import re
from typing import Any

from qpack.families.base import (
    TINY_BPE_RANKS,
    CheckpointFamily,
    TokenizerFacts,
    attention,
    mlp,
    residual_scale,
    routed_mlp,
    small_vocab,
)
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init

# GLM-4.5's added tokens, ids from 151329 on (its BPE vocabulary is the first 151329 ranks).
SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
    "<|begin_of_video|>", "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>",
    "<|begin_of_transcription|>", "<|end_of_transcription|>", "<|code_prefix|>",
    "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)
ENDOFTEXT, USER, OBSERVATION = 151329, 151336, 151338  # generation stops at any of them
# Markup the model writes as text, kept on decode so the reasoning and tool-call parsers see it.
MARKUP = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                    "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"})
PAT_GLM = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# The synthetic tokenizer: Qwen's byte-level BPE ranks cut to GLM's 151329 (the real GLM
# vocabulary is another BPE of that size), GLM's added tokens at their real ids.
TOKENIZER = TokenizerFacts("qwen.tiktoken", PAT_GLM, SPECIALS, ENDOFTEXT, 128000,
                           "PreTrainedTokenizerFast", MARKUP,
                           tuple(t for t in SPECIALS[1:] if t not in MARKUP), "<|endoftext|>",
                           "<|endoftext|>")

_GLM45 = dict(hidden_size=5120, num_experts=160, num_experts_per_tok=8, moe_intermediate_size=1536,
              num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
              intermediate_size=12288, num_hidden_layers=92, first_dense_layers=3, n_shared_experts=1,
              routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, rope_theta=1_000_000.0,
              partial_rotary_factor=0.5, rms_norm_eps=1e-5, max_position_embeddings=131072)
PRESETS = {
    # Grouped routing (4 groups, the best 2 kept) and a scaling factor, which the real
    # GLM-4.5 configs leave at one group: the tiny model exercises both code paths.
    "tiny": ModelDims(family="glm4_moe", name="tiny", hidden_size=64, num_hidden_layers=3, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=small_vocab(TOKENIZER),
                      bpe_ranks=TINY_BPE_RANKS, intermediate_size=128,
                      first_dense_layers=1, n_shared_experts=1, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                      rope_theta=1_000_000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
                      max_position_embeddings=4096),
    # Real dimensions (hub config.json). At 4 bits the Air is ~57 GB of experts and
    # GLM-4.5/4.6 ~190 GB: bench them with --max-layers (see docs/families.md).
    "glm-4.5-air": ModelDims(family="glm4_moe", name="glm-4.5-air", **dict(
        _GLM45, hidden_size=4096, num_experts=128, moe_intermediate_size=1408, intermediate_size=10944,
        num_hidden_layers=46, first_dense_layers=1, routed_scaling_factor=1.0,
        use_qk_norm=False)),  # type: ignore[arg-type]
    "glm-4.5": ModelDims(family="glm4_moe", name="glm-4.5", **_GLM45),  # type: ignore[arg-type]
    "glm-4.6": ModelDims(family="glm4_moe", name="glm-4.6", **dict(
        _GLM45, max_position_embeddings=202752)),  # type: ignore[arg-type]
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4Moe(CheckpointFamily):
    name = "glm4_moe"
    experts_key = "n_routed_experts"
    presets = PRESETS
    full_size = ("glm-4.5-air", "glm-4.5", "glm-4.6")
    variants = ("hybrid",)  # thinks unless enable_thinking is false (then /nothink, empty <think>)
    tokenizer = TOKENIZER
    template_file = True
    tool_calls = "kv"
    float32_suffixes = ("e_score_correction_bias",)  # mlx-lm's cast_predicate keeps it float32
    not_quantized = ("mlp.gate.weight",)  # MoEGate is no Linear: mlx_lm.convert leaves it float

    def target_name(self, name: str, text: dict[str, Any]) -> str | None:
        """The hub's names are mlx-lm's; the MTP layer (numbered num_hidden_layers) is dropped."""
        m = _LAYER.match(name)
        if m and int(m[1]) >= int(text.get("num_hidden_layers", 1 << 30)):
            return None
        return super().target_name(name, text)

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        h, p, res = dims.hidden_size, f"layers.{layer}.", residual_scale(dims)
        out = [
            (p + "input_layernorm.weight", self.norm_init(p + "input_layernorm.weight", h)),
            *attention(p, dims, self if dims.use_qk_norm else None, bias=dims.attention_bias),
            (p + "post_attention_layernorm.weight", self.norm_init(p + "post_attention_layernorm.weight", h)),
        ]
        if not dims.is_moe(layer):
            return out + mlp(p, "mlp.", h, dims.intermediate_size, res)
        return out + routed_mlp(p, dims, layer)

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        return {
            "_from_model_config": True,
            "eos_token_id": [ENDOFTEXT, USER, OBSERVATION],
            "pad_token_id": ENDOFTEXT,
            "transformers_version": "4.54.0",
        }

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        """config.json of zai-org/GLM-4.5-Air (Glm4MoeForCausalLM), with this preset's dimensions."""
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            "attention_bias": dims.attention_bias,
            "attention_dropout": 0.0,
            "pad_token_id": ENDOFTEXT,
            "eos_token_id": [ENDOFTEXT, USER, OBSERVATION],
            "head_dim": dims.head_dim,
            "hidden_act": "silu",
            "hidden_size": dims.hidden_size,
            "partial_rotary_factor": dims.partial_rotary_factor,
            "initializer_range": 0.02,
            "intermediate_size": dims.intermediate_size,
            "max_position_embeddings": dims.max_position_embeddings,
            "model_type": "glm4_moe",
            "moe_intermediate_size": dims.moe_intermediate_size,
            "norm_topk_prob": dims.norm_topk_prob,
            "num_attention_heads": dims.num_attention_heads,
            "n_group": dims.n_group,
            "topk_group": dims.topk_group,
            "n_routed_experts": dims.num_experts,
            "n_shared_experts": dims.n_shared_experts,
            "routed_scaling_factor": dims.routed_scaling_factor,
            "num_experts_per_tok": dims.num_experts_per_tok,
            "first_k_dense_replace": dims.first_dense_layers,
            "num_hidden_layers": dims.num_hidden_layers,
            "num_key_value_heads": dims.num_key_value_heads,
            "rms_norm_eps": dims.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": dims.rope_theta,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": dims.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "transformers_version": "4.54.0",
            "use_cache": True,
            "use_qk_norm": dims.use_qk_norm,
            "vocab_size": dims.vocab_size,
        }


FAMILY = Glm4Moe()
