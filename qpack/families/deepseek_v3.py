"""DeepSeek-V3 / V3-0324 / V3.1 / R1 and Kimi-K2 (model_type `deepseek_v3`, `kimi_k2` as an
alias, as mlx-lm maps it), as mlx_lm.models.deepseek_v3 and transformers' DeepseekV3ForCausalLM
read them.

Multi-head latent attention: q through a low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`,
keys and values from one compressed latent (`kv_a_proj_with_mqa`, `kv_a_layernorm`) plus a
shared rotary key, expanded per head by `kv_b_proj` [heads * (nope + v), kv_lora_rank], which
mlx-lm's sanitize splits into `embed_q` [heads, kv_lora_rank, nope] and `unembed_out`
[heads, v, kv_lora_rank] (the packer does the same, `dense_parts`). YaRN rope on the rotary
part. The first `first_k_dense_replace` layers have a dense SwiGLU MLP; the rest route over
`n_routed_experts` with a sigmoid router whose choice adds the float32
`e_score_correction_bias` and keeps the best `topk_group` of `n_group` groups (group score:
its best two), weights renormalized and scaled by `routed_scaling_factor`, plus
`n_shared_experts` shared experts (kept dense). The hub layout is flat and per-expert; its
MTP layer is `model.layers.{num_hidden_layers}` (mlx-lm drops layer 61, the packer any layer
past the config's count). The official V3.x repos are FP8 block-scaled (read as bf16 by
qpack.fp8). Config keys follow the hub's config.json of deepseek-ai/DeepSeek-V3 and
moonshotai/Kimi-K2-Instruct.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from qpack.families import kimi_chat
from qpack.families.base import (
    TINY_BPE_RANKS,
    CheckpointFamily,
    TokenizerFacts,
    linear,
    mlp,
    residual_scale,
    routed_mlp,
    small_vocab,
)
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init

BOS, EOS, PAD = 0, 1, 2
LEADING = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
# DeepSeek-V3.1's added tokens from 128000: 798 placeholders, then the markup.
MARKUP_TOKENS = (
    "<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>",
    "<｜Assistant｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>",
)
SPECIALS = (*(f"<｜place▁holder▁no▁{i}｜>" for i in range(798)), *MARKUP_TOKENS)
FIRST_SPECIAL = 128000
# Markup the model writes as text, kept on decode so the reasoning and tool-call parsers see it.
MARKUP = frozenset({"<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"})
PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
       r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# The synthetic tokenizer: BOS/EOS/pad at 0..2, Qwen's byte-level BPE ranks cut to fill ids
# 3..127999 (DeepSeek's own BPE has that size), DeepSeek's added tokens at their real ids.
TOKENIZER = TokenizerFacts("qwen.tiktoken", PAT, SPECIALS, FIRST_SPECIAL, 131072,
                           "LlamaTokenizerFast", MARKUP, (), LEADING[1], LEADING[1],
                           bos_token=LEADING[0], leading=LEADING)

# YaRN as the hub configs write it (rope_scaling), by preset.
_YARN_V3 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}
_YARN_KIMI = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}
_V3 = dict(hidden_size=7168, num_hidden_layers=61, num_experts=256, num_experts_per_tok=8,
           moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128, head_dim=128,
           vocab_size=129280, intermediate_size=18432, first_dense_layers=3, n_shared_experts=1,
           n_group=8, topk_group=4, routed_scaling_factor=2.5, rope_theta=10000.0,
           rms_norm_eps=1e-6, max_position_embeddings=163840, q_lora_rank=1536, kv_lora_rank=512,
           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_KIMI = dict(_V3, num_experts=384, num_attention_heads=64, num_key_value_heads=64, vocab_size=163840,
             first_dense_layers=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
             rope_theta=50000.0, max_position_embeddings=131072)
PRESETS = {
    # V3's routing (groups of the experts, the best half kept; scaling 2.5) and YaRN, at a
    # size MLX's CPU runs in milliseconds; every Linear's input a multiple of 64, and the
    # value head unlike the others (a swapped embed_q / unembed_out cannot load).
    "tiny": ModelDims(family="deepseek_v3", name="tiny", **dict(
        _V3, hidden_size=64, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        intermediate_size=128, first_dense_layers=1, n_group=4, topk_group=2, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=16, v_head_dim=128,
        vocab_size=small_vocab(TOKENIZER), bpe_ranks=TINY_BPE_RANKS)),  # type: ignore[arg-type]
    # Real dimensions (hub config.json). ~6.3 GB of 4-bit experts per MoE layer (Kimi-K2:
    # ~9.5 GB): bench them with --max-layers (see docs/families.md).
    "deepseek-v3": ModelDims(family="deepseek_v3", name="deepseek-v3", **_V3),  # type: ignore[arg-type]
    "kimi-k2": ModelDims(family="deepseek_v3", name="kimi-k2", **_KIMI),  # type: ignore[arg-type]
    # Kimi-K2's routing (one group, scaling 2.827), YaRN and vocabulary (its own tokenizer's
    # 163840 ids) at the tiny sizes: what the Kimi chat is served on in the tests.
    "kimi-tiny": ModelDims(family="deepseek_v3", name="kimi-tiny", **dict(
        _KIMI, hidden_size=64, num_hidden_layers=3, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        intermediate_size=128, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64,
        qk_rope_head_dim=16, v_head_dim=128)),  # type: ignore[arg-type]
}
ROPE_SCALING = {"tiny": _YARN_V3, "deepseek-v3": _YARN_V3, "kimi-k2": _YARN_KIMI, "kimi-tiny": _YARN_KIMI}


class Chat(NamedTuple):
    """What a chat variant's release ships: its tokenizer, chat template, tool-call style,
    and the BOS / EOS ids of its config.json."""

    tokenizer: TokenizerFacts
    template: str
    tool_calls: str
    bos_eos: tuple[int, int]
    generation: dict[str, Any]  # generation_config.json


# deepseek-ai/DeepSeek-V3.1's generation_config.json.
_GENERATION = {"_from_model_config": True, "bos_token_id": BOS, "eos_token_id": EOS, "do_sample": True,
               "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"}
# V3.1's own chat, and Kimi-K2's (Moonshot's tokenizer and markup on this architecture).
CHATS = {"hybrid": Chat(TOKENIZER, "deepseek_v3", "sep", (BOS, EOS), _GENERATION),
         "kimi-k2": Chat(kimi_chat.TOKENIZER, "kimi_k2", "kimi", (kimi_chat.BOS, kimi_chat.EOS),
                         kimi_chat.GENERATION)}
# The chat each preset's release ships.
PRESET_CHAT = {"tiny": "hybrid", "deepseek-v3": "hybrid", "kimi-k2": "kimi-k2", "kimi-tiny": "kimi-k2"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_KV_B = "self_attn.kv_b_proj.weight"
_PARTS = ("self_attn.embed_q.weight", "self_attn.unembed_out.weight")
_KV_B_QUANT = ("self_attn.kv_b_proj.scales", "self_attn.kv_b_proj.biases")


def _sibling(weight: str, part: str) -> str:
    return weight.removesuffix("weight") + part


def _kv_b_quant(weight: tuple[int, ...], scales: tuple[int, ...], text: dict[str, Any]) -> tuple[int, int]:
    """(bits, group size) of a quantized kv_b_proj, read off its shapes as mlx-lm does."""
    rank = int(text["kv_lora_rank"])
    return weight[-1] * 32 // rank, rank // scales[-1]


def split_kv_b(w: Any, part: str, text: dict[str, Any]) -> Any:
    """embed_q or unembed_out from kv_b_proj [heads * (nope + v), rank], as mlx-lm's
    sanitize cuts it (numpy or MLX arrays: the same reshape, slice and swap)."""
    heads, nope = int(text["num_attention_heads"]), int(text["qk_nope_head_dim"])
    v = w.reshape(heads, nope + int(text["v_head_dim"]), -1)
    return v[:, :nope, :].swapaxes(-1, -2) if ".embed_q" in part else v[:, nope:, :]


def _cut(full: Callable[[Init], np.ndarray], init: Init, part: str, text: dict[str, Any]) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(split_kv_b(full(init), part, text))


class DeepseekV3(CheckpointFamily):
    name = "deepseek_v3"
    aliases = ("kimi_k2",)
    experts_key = "n_routed_experts"
    presets = PRESETS
    full_size = ("deepseek-v3", "kimi-k2")
    # hybrid (V3.1): answers directly unless `thinking` (or enable_thinking) is true;
    # kimi-k2: Kimi-K2-Instruct's tokenizer and chat (the Kimi presets).
    variants = tuple(CHATS)
    tokenizer = TOKENIZER
    tool_calls = "sep"
    float32_suffixes = ("e_score_correction_bias",)  # mlx-lm's cast_predicate keeps it float32
    not_quantized = ("mlp.gate.weight",)  # MoEGate is no Linear: mlx_lm.convert leaves it float
    multi_linear = ("self_attn.embed_q.weight", "self_attn.unembed_out.weight")

    def preset_variants(self, preset: str) -> tuple[str, ...]:
        return (PRESET_CHAT.get(preset, "hybrid"),)

    def tokenizer_facts(self, variant: str) -> TokenizerFacts:
        return CHATS[variant].tokenizer

    def tool_call_style(self, variant: str) -> str:
        return CHATS[variant].tool_calls

    def template_name(self, variant: str) -> str:
        return CHATS[variant].template

    def target_name(self, name: str, text: dict[str, Any]) -> str | None:
        """The hub's names are mlx-lm's but for kv_b_proj (split, `dense_parts`); the MTP
        layer (numbered num_hidden_layers) and precomputed rotary frequencies are dropped."""
        m = _LAYER.match(name)
        if (m and int(m[1]) >= int(text.get("num_hidden_layers", 1 << 30))) or "rotary_emb.inv_freq" in name:
            return None
        return super().target_name(name, text)

    def dense_parts(self, target: str, quantized: bool) -> tuple[str, ...]:
        """kv_b_proj -> embed_q, unembed_out (with their scales and biases from a quantized
        source: mlx-lm's conversions before its MultiLinear split quantized kv_b_proj whole)."""
        if target.endswith(_KV_B):
            base = target[: -len(_KV_B)]
            kinds = ("weight", "scales", "biases") if quantized else ("weight",)
            return tuple(base + p.replace(".weight", f".{k}") for p in _PARTS for k in kinds)
        if quantized and target.endswith(_KV_B_QUANT):
            return ()
        return (target,)

    def dense_part_plan(self, part: str, source: str, info: Any, text: dict[str, Any],
                        quantized: bool) -> tuple[str, tuple[int, ...]]:
        module, kind = part.rsplit(".", 1)
        w = info(source)
        if not quantized:
            return w.dtype, tuple(split_kv_b(np.empty(w.shape, np.uint8), module, text).shape)
        bits, group_size = _kv_b_quant(w.shape, info(_sibling(source, "scales")).shape, text)
        rank = int(text["kv_lora_rank"])
        cut = split_kv_b(np.empty((w.shape[0], rank), np.uint8), module, text).shape
        from qpack.quantize import Rule, quantized_shapes  # MLX: not at import (the CLI's help)

        shapes = quantized_shapes(tuple(cut), Rule(bits, group_size))
        return ("U32" if kind == "weight" else info(_sibling(source, "scales")).dtype), shapes[kind]

    def dense_part(self, part: str, source: str, read: Any, text: dict[str, Any], quantized: bool) -> Any:
        import mlx.core as mx

        module, kind = part.rsplit(".", 1)
        w = read(source)
        if not quantized:
            return mx.contiguous(split_kv_b(w, module, text))
        # mlx-lm's sanitize: dequantize, cut, quantize again at the bits and group size
        # the shapes say (affine: mx.dequantize's default).
        scales, biases = read(_sibling(source, "scales")), read(_sibling(source, "biases"))
        bits, group_size = _kv_b_quant(w.shape, scales.shape, text)
        whole = mx.dequantize(w, scales, biases, bits=bits, group_size=group_size)
        cut = mx.contiguous(split_kv_b(whole, module, text))
        return dict(zip(("weight", "scales", "biases"), mx.quantize(cut, bits=bits, group_size=group_size),
                        strict=True))[kind]

    def mlx_split(self, rel: str, init: Init, full: Callable[[Init], np.ndarray],
                  dims: ModelDims) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] | None:
        """What mlx_lm.convert writes for kv_b_proj: its two per-head parts (same values)."""
        if not rel.endswith(_KV_B):
            return None
        text = {"num_attention_heads": dims.num_attention_heads, "qk_nope_head_dim": dims.qk_nope_head_dim,
                "v_head_dim": dims.v_head_dim}
        base = rel[: -len(_KV_B)]
        out = []
        for p in _PARTS:
            shape = tuple(split_kv_b(np.empty(init.shape, np.uint8), p, text).shape)
            out.append((base + p, shape, _cut(full, init, p, text)))
        return out

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        h, p, res = dims.hidden_size, f"layers.{layer}.", residual_scale(dims)
        heads, rope = dims.num_attention_heads, dims.qk_rope_head_dim
        a = p + "self_attn."
        out = [
            (p + "input_layernorm.weight", self.norm_init(p + "input_layernorm.weight", h)),
            linear(a, "q_a_proj.weight", dims.q_lora_rank, h),
            (a + "q_a_layernorm.weight", self.norm_init(a + "q_a_layernorm.weight", dims.q_lora_rank)),
            linear(a, "q_b_proj.weight", heads * (dims.qk_nope_head_dim + rope), dims.q_lora_rank),
            linear(a, "kv_a_proj_with_mqa.weight", dims.kv_lora_rank + rope, h),
            (a + "kv_a_layernorm.weight", self.norm_init(a + "kv_a_layernorm.weight", dims.kv_lora_rank)),
            linear(a, "kv_b_proj.weight", heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank),
            linear(a, "o_proj.weight", h, heads * dims.v_head_dim, res),
            (p + "post_attention_layernorm.weight", self.norm_init(p + "post_attention_layernorm.weight", h)),
        ]
        if not dims.is_moe(layer):
            return out + mlp(p, "mlp.", h, dims.intermediate_size, res)
        return out + routed_mlp(p, dims, layer)

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        """The chat's generation_config.json (DeepSeek-V3.1's, Kimi-K2-Instruct's)."""
        return dict(CHATS[variant].generation)

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        """config.json of deepseek-ai/DeepSeek-V3.1 (DeepseekV3ForCausalLM; the FP8 block
        quantization_config and the auto_map to its remote code left out: synth writes float
        weights, and mlx-lm and transformers have the architecture), this preset's dimensions
        and its chat's BOS / EOS ids (Kimi-K2's config.json: 163584 / 163585)."""
        bos, eos = CHATS[PRESET_CHAT.get(dims.name, "hybrid")].bos_eos
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "ep_size": 1,
            "first_k_dense_replace": dims.first_dense_layers,
            "hidden_act": "silu",
            "hidden_size": dims.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": dims.intermediate_size,
            "kv_lora_rank": dims.kv_lora_rank,
            "max_position_embeddings": dims.max_position_embeddings,
            "model_type": "deepseek_v3",
            "moe_intermediate_size": dims.moe_intermediate_size,
            "moe_layer_freq": 1,
            "n_group": dims.n_group,
            "n_routed_experts": dims.num_experts,
            "n_shared_experts": dims.n_shared_experts,
            "norm_topk_prob": dims.norm_topk_prob,
            "num_attention_heads": dims.num_attention_heads,
            "num_experts_per_tok": dims.num_experts_per_tok,
            "num_hidden_layers": dims.num_hidden_layers,
            "num_key_value_heads": dims.num_key_value_heads,
            "num_nextn_predict_layers": 1,
            "pretraining_tp": 1,
            "q_lora_rank": dims.q_lora_rank,
            "qk_nope_head_dim": dims.qk_nope_head_dim,
            "qk_rope_head_dim": dims.qk_rope_head_dim,
            "rms_norm_eps": dims.rms_norm_eps,
            "rope_scaling": dict(ROPE_SCALING.get(dims.name, _YARN_V3)),
            "rope_theta": dims.rope_theta,
            "routed_scaling_factor": dims.routed_scaling_factor,
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "tie_word_embeddings": dims.tie_word_embeddings,
            "topk_group": dims.topk_group,
            "topk_method": "noaux_tc",
            "torch_dtype": torch_dtype,
            "transformers_version": "4.44.2",
            "use_cache": True,
            "v_head_dim": dims.v_head_dim,
            "vocab_size": dims.vocab_size,
        }


FAMILY = DeepseekV3()
