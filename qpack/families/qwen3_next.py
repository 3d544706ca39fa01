"""Qwen3-Next (model_type `qwen3_next`): Qwen3-Next-80B-A3B Instruct and Thinking.

Hybrid layers: Gated DeltaNet in three of every four, gated full attention in the fourth;
512 routed experts (top-10) plus one shared expert behind a sigmoid gate. The hub layout
is flat: `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` per expert, fused
`linear_attn.in_proj_qkvz` / `in_proj_ba`, conv1d [C, 1, K] and zero-centred norms
(mlx-lm's sanitize adds 1 and moves the conv axis). Config keys follow the hub's
config.json of Qwen/Qwen3-Next-80B-A3B-Instruct.
"""

from __future__ import annotations

import math
from typing import Any

from qpack.families.base import (
    TINY_BPE_RANKS,
    CheckpointFamily,
    TokenizerFacts,
    attention,
    linear,
    mlp,
    residual_scale,
    router,
    small_vocab,
    vector,
)
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import NORM_STD, Init

# Special token ids of the real tokenizer.
BOS, EOS = 151643, 151645
# Qwen2/Qwen3 added tokens, ids from 151643 on (Qwen3.5/3.6 keep the order and add more).
SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
# Markup the model writes as text: kept on decode even with skip_special_tokens, so reasoning
# and tool-call parsers see it (the real tokenizers mark these special=false too).
NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>"})
ADDITIONAL = ("<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
              "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
              "<|video_pad|>")
PAT_QWEN3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
             r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN3_TOKENIZER = TokenizerFacts("qwen.tiktoken", PAT_QWEN3, SPECIALS, 151643, 262144, "Qwen2Tokenizer",
                                 NOT_SPECIAL, ADDITIONAL, "<|im_end|>", "<|endoftext|>")
# mlx-lm's sanitize adds 1 to these (the hub stores the offset from 1).
NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                ".k_norm.weight")

_TINY = dict(
    hidden_size=64, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
    moe_intermediate_size=64, shared_expert_intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    intermediate_size=128, max_position_embeddings=4096, full_attention_interval=4,
)
# ~1.1 GB (qwen3_next) / ~1.4 GB (qwen3_5_moe, larger vocab) in bf16; a decode step reads
# 8 of 128 experts x 8 layers, well under a second on two CPU cores.
_DEMO = dict(
    hidden_size=768, num_hidden_layers=8, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=128, shared_expert_intermediate_size=256, num_attention_heads=6,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_key_head_dim=128,
    linear_num_value_heads=8, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    intermediate_size=1536, max_position_embeddings=32768, full_attention_interval=4,
)
# A scaled-down model whose experts have the real models' size (1024 x 1024 per
# projection, ~1.7 MiB at 4 bits) and dominate the bytes a token touches, so a small CPU
# machine reading them from disk is I/O-bound as the full-size models are on a GPU.
_CPU_BENCH = dict(_DEMO, hidden_size=1024, num_experts=64, num_experts_per_tok=4,
                  moe_intermediate_size=1024, num_attention_heads=8)
# What the two real A3B models share: the attention, Gated DeltaNet and expert shapes.
A3B = dict(
    hidden_size=2048, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4,
)


def small_presets(family: str, vocab: int, tokenizer: TokenizerFacts) -> dict[str, ModelDims]:
    """tiny / demo / cpu-bench of a Qwen hybrid family (same shapes, the family's vocab;
    tiny's cut to its first BPE ranks, `TINY_BPE_RANKS`)."""
    tiny = ModelDims(family=family, name="tiny", vocab_size=small_vocab(tokenizer),
                     bpe_ranks=TINY_BPE_RANKS, **_TINY)  # type: ignore[arg-type]
    # tiny with attention heads 64 wide: a quantized KV cache's default groups (64) fit
    # (compute.kv_bits; tests/test_kv_quant.py).
    tiny_kv = ModelDims(family=family, name="tiny-kv", vocab_size=small_vocab(tokenizer),
                        bpe_ranks=TINY_BPE_RANKS, **(_TINY | {"head_dim": 64}))  # type: ignore[arg-type]
    return {"tiny": tiny, "tiny-kv": tiny_kv} | {
        name: ModelDims(family=family, name=name, vocab_size=vocab, **dims)  # type: ignore[arg-type]
        for name, dims in (("demo", _DEMO), ("cpu-bench", _CPU_BENCH))}


def flatten_rope_parameters(cfg: dict) -> None:
    """transformers 5 re-saves Qwen3-Next configs with `rope_theta` and
    `partial_rotary_factor` only inside `rope_parameters`; mlx-lm's qwen3_next ModelArgs
    wants them at the top level (and a non-default rope type as `rope_scaling`)."""
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in cfg and key in rope:
            cfg[key] = rope[key]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if cfg.get("rope_scaling") is None and kind != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_type")}
        cfg["rope_scaling"] = {"type": kind, **scaling}


def hybrid_inits(family: CheckpointFamily, dims: ModelDims, layer: int,
                 split_in_proj: bool) -> list[tuple[str, Init]]:
    """One Qwen hybrid decoder layer but its routed experts. `split_in_proj`: Qwen3.5's
    separate in_proj_qkv / z / b / a (Qwen3-Next fuses them as in_proj_qkvz / ba)."""
    h, p, res = dims.hidden_size, f"layers.{layer}.", residual_scale(dims)
    out = [(p + "input_layernorm.weight", family.norm_init(p + "input_layernorm.weight", h))]
    nv, kd, vd = dims.linear_num_value_heads, dims.key_dim, dims.value_dim
    if dims.is_linear(layer):
        if split_in_proj:
            out += [
                linear(p, "linear_attn.in_proj_qkv.weight", 2 * kd + vd, h),
                linear(p, "linear_attn.in_proj_z.weight", vd, h),
                linear(p, "linear_attn.in_proj_b.weight", nv, h),
                linear(p, "linear_attn.in_proj_a.weight", nv, h),
            ]
        else:
            out += [
                linear(p, "linear_attn.in_proj_qkvz.weight", 2 * kd + 2 * vd, h),
                linear(p, "linear_attn.in_proj_ba.weight", 2 * nv, h),
            ]
        k = dims.linear_conv_kernel_dim
        conv = p + "linear_attn.conv1d.weight"
        out += [
            (conv, Init(conv, (dims.conv_dim, 1, k), "normal", 1.0 / math.sqrt(k))),
            (p + "linear_attn.A_log", Init(p + "linear_attn.A_log", (nv,), "a_log")),
            vector(p, "linear_attn.dt_bias", nv, -1.0, 0.5),
            vector(p, "linear_attn.norm.weight", dims.linear_value_head_dim, 1.0, NORM_STD),
            linear(p, "linear_attn.out_proj.weight", h, vd, res),
        ]
    else:  # gated attention: q_proj also yields the output gate
        out += attention(p, dims, family, q_out=2 * dims.num_attention_heads * dims.head_dim)
    si = dims.shared_expert_intermediate_size
    out += [
        (p + "post_attention_layernorm.weight", family.norm_init(p + "post_attention_layernorm.weight", h)),
        router(p, dims, layer),
        *mlp(p, "mlp.shared_expert.", h, si, res),
        linear(p, "mlp.shared_expert_gate.weight", 1, h),
    ]
    return out


def hybrid_fixups(target: str, shape: tuple[int, ...], hf_norms: bool, hf_conv: bool) -> tuple[bool, bool]:
    """(moveaxis, plus_one) of the hybrids' sanitize: conv1d [C, 1, K] -> [C, K, 1] and
    zero-centred norms + 1, each only where the checkpoint is not sanitized yet."""
    moveaxis = hf_conv and "conv1d.weight" in target and shape[-1] != 1
    plus_one = hf_norms and len(shape) == 1 and target.endswith(NORM_SUFFIXES)
    return moveaxis, plus_one


class Qwen3Next(CheckpointFamily):
    name = "qwen3_next"
    mtp_head = True
    per_expert_mtp = True
    presets = {
        **small_presets("qwen3_next", 151936, QWEN3_TOKENIZER),
        "qwen3-next-80b-a3b": ModelDims(family="qwen3_next", name="qwen3-next-80b-a3b",
                                        num_hidden_layers=48, num_experts=512, num_experts_per_tok=10,
                                        vocab_size=151936, intermediate_size=5120, **A3B),  # type: ignore[arg-type]
    }
    full_size = ("qwen3-next-80b-a3b",)
    layouts = ("hub", "per-expert")  # the hub layout already is per-expert
    variants = ("instruct", "thinking")
    tokenizer = QWEN3_TOKENIZER
    published_routing = True  # the Qwen3-Next / Qwen3.5 traces of actors/routing_model/families.py
    zero_centred = ZERO_CENTRED
    routers_8bit = ("mlp.gate", "shared_expert_gate")

    def fix_config(self, config: dict[str, Any]) -> None:
        flatten_rope_parameters(config)

    def dense_fixups(self, target: str, shape: tuple[int, ...], is_mlx: bool,
                     conv_unsanitized: bool) -> tuple[bool, bool]:
        # Its sanitize is a no-op unless per-expert HF keys exist: an MLX checkpoint is done.
        return hybrid_fixups(target, shape, hf_norms=not is_mlx, hf_conv=not is_mlx)

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        return hybrid_inits(self, dims, layer, split_in_proj=False)

    def template_name(self, variant: str) -> str:
        return "qwen3_next_thinking" if variant == "thinking" else "qwen3_next"

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        """Instruct 0.7/0.8/20, Thinking 0.6/0.95/20; eos <|im_end|> and <|endoftext|>."""
        thinking = variant == "thinking"
        return {
            "bos_token_id": BOS,
            "do_sample": True,
            "eos_token_id": [EOS, BOS],
            "pad_token_id": BOS,
            "temperature": 0.6 if thinking else 0.7,
            "top_k": 20,
            "top_p": 0.95 if thinking else 0.8,
            "transformers_version": "4.57.0.dev0",
        }

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        """config.json of Qwen3-Next-80B-A3B-Instruct, with this preset's dimensions.

        mlx-lm reads `rope_theta` and `partial_rotary_factor` at the top level, as the hub has them.
        """
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": BOS,
            "decoder_sparse_step": 1,
            "eos_token_id": EOS,
            "full_attention_interval": dims.full_attention_interval,
            "head_dim": dims.head_dim,
            "hidden_act": "silu",
            "hidden_size": dims.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": dims.intermediate_size,
            "linear_conv_kernel_dim": dims.linear_conv_kernel_dim,
            "linear_key_head_dim": dims.linear_key_head_dim,
            "linear_num_key_heads": dims.linear_num_key_heads,
            "linear_num_value_heads": dims.linear_num_value_heads,
            "linear_value_head_dim": dims.linear_value_head_dim,
            "max_position_embeddings": dims.max_position_embeddings,
            "mlp_only_layers": [],
            "model_type": "qwen3_next",
            "moe_intermediate_size": dims.moe_intermediate_size,
            "norm_topk_prob": dims.norm_topk_prob,
            "num_attention_heads": dims.num_attention_heads,
            "num_experts": dims.num_experts,
            "num_experts_per_tok": dims.num_experts_per_tok,
            "num_hidden_layers": dims.num_hidden_layers,
            "num_key_value_heads": dims.num_key_value_heads,
            "output_router_logits": False,
            "partial_rotary_factor": dims.partial_rotary_factor,
            "rms_norm_eps": dims.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": dims.rope_theta,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": dims.shared_expert_intermediate_size,
            "tie_word_embeddings": dims.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "transformers_version": "4.57.0.dev0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": dims.vocab_size,
        }


FAMILY = Qwen3Next()
