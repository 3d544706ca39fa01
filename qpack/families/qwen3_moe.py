"""Qwen3 MoE (model_type `qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B and their 2507
Instruct / Thinking releases, Qwen3-Coder-30B-A3B / 480B-A35B.

Full attention in every layer (q/k RMSNorm, no bias), 128 routed experts (Coder-480B: 160)
with a softmax top-8 router and norm_topk_prob, no shared expert; standard RMSNorm weights
(not zero-centred). The hub layout is flat and per-expert:
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, `model.layers.{i}.mlp.gate.weight`.
mlx-lm (mlx_lm.models.qwen3_moe) stacks the experts as `mlp.switch_mlp.*` and puts the
router at 8 bits. Config keys follow the hub's config.json of Qwen/Qwen3-30B-A3B and
Qwen/Qwen3-235B-A22B (transformers' Qwen3MoeConfig).
"""

from __future__ import annotations

from typing import Any

from qpack.families.base import TINY_BPE_RANKS, CheckpointFamily, attention, router, small_vocab
from qpack.families.qwen3_next import BOS, EOS, QWEN3_TOKENIZER
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init

_SMALL = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1_000_000.0,
              partial_rotary_factor=1.0, max_position_embeddings=4096)
# Real dimensions (hub config.json). 30B-A3B fits a 40 GB container whole at 4 bits
# (~17 GB); 235B-A22B is ~130 GB at 4 bits: bench it with --max-layers.
_REAL = dict(head_dim=128, rope_theta=1_000_000.0, partial_rotary_factor=1.0,
             max_position_embeddings=40960, vocab_size=151936, num_experts_per_tok=8)
PRESETS = {
    "tiny": ModelDims(family="qwen3_moe", name="tiny", hidden_size=64, num_hidden_layers=2, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=64,
                      vocab_size=small_vocab(QWEN3_TOKENIZER), bpe_ranks=TINY_BPE_RANKS,
                      intermediate_size=128, **_SMALL),  # type: ignore[arg-type]
    "demo": ModelDims(family="qwen3_moe", name="demo", hidden_size=768, num_hidden_layers=8, num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=128, vocab_size=151936,
                      intermediate_size=1536, **dict(_SMALL, num_attention_heads=6,
                                                     head_dim=128)),  # type: ignore[arg-type]
    "qwen3-30b-a3b": ModelDims(family="qwen3_moe", name="qwen3-30b-a3b", hidden_size=2048,
                               num_hidden_layers=48, num_experts=128, moe_intermediate_size=768,
                               num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
                               **_REAL),  # type: ignore[arg-type]
    "qwen3-235b-a22b": ModelDims(family="qwen3_moe", name="qwen3-235b-a22b", hidden_size=4096,
                                 num_hidden_layers=94, num_experts=128, moe_intermediate_size=1536,
                                 num_attention_heads=64, num_key_value_heads=4, intermediate_size=12288,
                                 **_REAL),  # type: ignore[arg-type]
}


class Qwen3Moe(CheckpointFamily):
    name = "qwen3_moe"
    presets = PRESETS
    full_size = ("qwen3-30b-a3b", "qwen3-235b-a22b")
    # hybrid: Qwen3-30B-A3B / 235B-A22B (thinks unless enable_thinking is false);
    # instruct / thinking: the 2507 releases, whose templates are Qwen3-Next's.
    variants = ("hybrid", "instruct", "thinking")
    tokenizer = QWEN3_TOKENIZER
    routers_8bit = ("mlp.gate",)  # mlx_lm.models.qwen3_moe.Model.quant_predicate

    def template_name(self, variant: str) -> str:
        return {"hybrid": "qwen3_moe", "instruct": "qwen3_next", "thinking": "qwen3_next_thinking"}[variant]

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        h, p = dims.hidden_size, f"layers.{layer}."
        return [
            (p + "input_layernorm.weight", self.norm_init(p + "input_layernorm.weight", h)),
            *attention(p, dims, self),
            (p + "post_attention_layernorm.weight", self.norm_init(p + "post_attention_layernorm.weight", h)),
            router(p, dims, layer),
        ]

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        """Qwen3's: thinking 0.6/0.95/20 (hybrid and Thinking-2507), Instruct-2507 0.7/0.8/20."""
        instruct = variant == "instruct"
        return {
            "bos_token_id": BOS,
            "do_sample": True,
            "eos_token_id": [EOS, BOS],
            "pad_token_id": BOS,
            "temperature": 0.7 if instruct else 0.6,
            "top_k": 20,
            "top_p": 0.8 if instruct else 0.95,
            "transformers_version": "4.51.0",
        }

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        """config.json of Qwen/Qwen3-30B-A3B (Qwen3MoeForCausalLM), with this preset's dimensions."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": BOS,
            "decoder_sparse_step": 1,
            "eos_token_id": EOS,
            "head_dim": dims.head_dim,
            "hidden_act": "silu",
            "hidden_size": dims.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": dims.intermediate_size,
            "max_position_embeddings": dims.max_position_embeddings,
            "max_window_layers": dims.num_hidden_layers,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": dims.moe_intermediate_size,
            "norm_topk_prob": dims.norm_topk_prob,
            "num_attention_heads": dims.num_attention_heads,
            "num_experts": dims.num_experts,
            "num_experts_per_tok": dims.num_experts_per_tok,
            "num_hidden_layers": dims.num_hidden_layers,
            "num_key_value_heads": dims.num_key_value_heads,
            "output_router_logits": False,
            "rms_norm_eps": dims.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": dims.rope_theta,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": dims.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": dims.vocab_size,
        }


FAMILY = Qwen3Moe()
