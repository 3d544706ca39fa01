"""Model dimensions of the synthetic checkpoints, and their config.json as the hub writes it.

Two families: `qwen3_next` (Qwen3-Next: flat config, fused `in_proj_qkvz`/`in_proj_ba`,
per-expert tensors) and `qwen3_5_moe` (Qwen3.5/3.6 MoE: `text_config` nested in a multimodal
config, split `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a`, fused expert tensors).
Field names follow the hub's config.json of Qwen/Qwen3-Next-80B-A3B-Instruct and
Qwen/Qwen3.6-35B-A3B (Qwen3.5-35B-A3B has the same layout).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

Family = Literal["qwen3_next", "qwen3_5_moe"]
FAMILIES: tuple[str, ...] = ("qwen3_next", "qwen3_5_moe")

# Special token ids of the real tokenizers (see qpack.tokenizer).
QWEN3_NEXT_BOS, QWEN3_NEXT_EOS = 151643, 151645
QWEN3_5_EOS = 248044
QWEN3_5_IM_END = 248046


class ModelDims(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything that sets tensor shapes and the config of one synthetic model."""

    family: Family
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    vocab_size: int
    full_attention_interval: int = 4
    intermediate_size: int = 5120  # qwen3_next's dense MLP width (unused: every layer is MoE)
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        """Gated DeltaNet layer (True) or gated full attention (False), as both libraries decide."""
        return (layer + 1) % self.full_attention_interval != 0

    def layer_types(self) -> list[str]:
        return [
            "linear_attention" if self.is_linear(i) else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def check(self) -> None:
        """Refuse dimensions that 64-group quantization or the model code cannot take."""
        inputs = {
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "num_attention_heads*head_dim": self.num_attention_heads * self.head_dim,
            "linear value dim": self.value_dim,
        }
        for what, value in inputs.items():
            if value % 64:
                raise ValueError(
                    f"preset {self.family}/{self.name}: {what}={value} is the input dim of a "
                    "Linear and must be a multiple of 64 for group-64 quantization"
                )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"preset {self.family}/{self.name}: linear_num_value_heads must be a multiple "
                "of linear_num_key_heads"
            )


_TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_num_value_heads=4,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    intermediate_size=128,
    max_position_embeddings=4096,
)
# ~1.1 GB (qwen3_next) / ~1.4 GB (qwen3_5_moe, larger vocab) in bf16; a decode step reads
# 8 of 128 experts x 8 layers, well under a second on two CPU cores.
_DEMO = dict(
    hidden_size=768,
    num_hidden_layers=8,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_key_head_dim=128,
    linear_num_value_heads=8,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=1536,
    max_position_embeddings=32768,
)

# A scaled-down model whose experts have the real models' size (1024 x 1024 per
# projection, ~1.7 MiB at 4 bits) and dominate the bytes a token touches, so a small CPU
# machine reading them from disk is I/O-bound as the full-size models are on a GPU.
_CPU_BENCH = dict(
    _DEMO,
    hidden_size=1024,
    num_experts=64,
    num_experts_per_tok=4,
    moe_intermediate_size=1024,
    num_attention_heads=8,
)

PRESETS: dict[tuple[str, str], ModelDims] = {}
# The ignores below: `_fam` is one of FAMILIES (the `family` Literal's values) and the
# dims dicts hold only int fields; the checker sees a str and a dict[str, int].
for _fam in FAMILIES:
    _vocab = 151936 if _fam == "qwen3_next" else 248320
    PRESETS[(_fam, "tiny")] = ModelDims(family=_fam, name="tiny", vocab_size=_vocab, **_TINY)  # type: ignore[arg-type]
    PRESETS[(_fam, "demo")] = ModelDims(family=_fam, name="demo", vocab_size=_vocab, **_DEMO)  # type: ignore[arg-type]
    PRESETS[(_fam, "cpu-bench")] = ModelDims(
        family=_fam, name="cpu-bench", vocab_size=_vocab, **_CPU_BENCH  # type: ignore[arg-type]
    )

# What the two real A3B models share: the attention, Gated DeltaNet and expert shapes.
_A3B = dict(
    hidden_size=2048,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_num_value_heads=32,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
PRESETS[("qwen3_next", "qwen3-next-80b-a3b")] = ModelDims(
    family="qwen3_next",
    name="qwen3-next-80b-a3b",
    num_hidden_layers=48,
    num_experts=512,
    num_experts_per_tok=10,
    vocab_size=151936,
    intermediate_size=5120,
    **_A3B,  # type: ignore[arg-type]  # int fields only (see the loop above)
)
PRESETS[("qwen3_5_moe", "qwen3.6-35b-a3b")] = ModelDims(
    family="qwen3_5_moe",
    name="qwen3.6-35b-a3b",
    num_hidden_layers=40,
    num_experts=256,
    num_experts_per_tok=8,
    vocab_size=248320,
    **_A3B,  # type: ignore[arg-type]  # int fields only
)
# Named presets that imply their family.
FULL_SIZE: dict[str, str] = {"qwen3-next-80b-a3b": "qwen3_next", "qwen3.6-35b-a3b": "qwen3_5_moe"}


def preset_names() -> list[str]:
    return sorted({name for _, name in PRESETS})


def get_preset(family: str | None, preset: str) -> ModelDims:
    """Look up a preset; a full-size preset name implies its family (and must agree with it)."""
    implied = FULL_SIZE.get(preset)
    if implied is not None:
        if family is not None and family != implied:
            raise ValueError(f"preset {preset!r} belongs to family {implied!r}, not {family!r}")
        family = implied
    if family is None:
        raise ValueError(f"preset {preset!r} needs a family: one of {list(FAMILIES)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: expected one of {list(FAMILIES)}")
    dims = PRESETS.get((family, preset))
    if dims is None:
        names = sorted(name for fam, name in PRESETS if fam == family)
        raise ValueError(f"unknown preset {preset!r} for family {family!r}: expected one of {names}")
    dims.check()
    return dims


def _mrope_section(dims: ModelDims) -> list[int]:
    # Split the rotary half-dim into (temporal, height, width) as the hub's [11, 11, 10] does
    # for 64 rotary dims; smaller presets get the same proportions.
    half = int(dims.head_dim * dims.partial_rotary_factor) // 2
    a = math.ceil(half / 3)
    return [a, a, half - 2 * a]


def qwen3_next_config(dims: ModelDims, torch_dtype: str) -> dict[str, Any]:
    """config.json of Qwen3-Next-80B-A3B-Instruct, with this preset's dimensions.

    mlx-lm reads `rope_theta` and `partial_rotary_factor` at the top level, as the hub has them.
    """
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": QWEN3_NEXT_BOS,
        "decoder_sparse_step": 1,
        "eos_token_id": QWEN3_NEXT_EOS,
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


def qwen3_5_text_config(dims: ModelDims, torch_dtype: str) -> dict[str, Any]:
    """The `text_config` of Qwen3.6-35B-A3B (model_type `qwen3_5_moe_text`)."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": torch_dtype,
        "eos_token_id": QWEN3_5_EOS,
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
    full = dims.name == "qwen3.6-35b-a3b"
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


def qwen3_5_moe_config(dims: ModelDims, torch_dtype: str) -> dict[str, Any]:
    """config.json of Qwen3.6-35B-A3B (Qwen3_5MoeForConditionalGeneration), this preset's dims."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": qwen3_5_text_config(dims, torch_dtype),
        "tie_word_embeddings": dims.tie_word_embeddings,
        "transformers_version": "4.57.1",
        "video_token_id": 248057,
        "vision_config": _vision_config(dims),
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def qwen3_5_moe_text_only_config(dims: ModelDims, torch_dtype: str) -> dict[str, Any]:
    """Flat config of transformers 5's text-only class (Qwen3_5MoeForCausalLM)."""
    cfg = qwen3_5_text_config(dims, torch_dtype)
    return {"architectures": ["Qwen3_5MoeForCausalLM"], **cfg, "tie_word_embeddings": False}


def hf_config(dims: ModelDims, torch_dtype: str, layout: str = "hub") -> dict[str, Any]:
    """The source checkpoint's config.json for `layout` ("hub" or "per-expert")."""
    if dims.family == "qwen3_next":
        if layout not in ("hub", "per-expert"):
            raise ValueError(f"unknown layout {layout!r}: expected 'hub' or 'per-expert'")
        # Qwen3-Next's hub layout already is per-expert.
        return qwen3_next_config(dims, torch_dtype)
    if layout == "hub":
        return qwen3_5_moe_config(dims, torch_dtype)
    if layout == "per-expert":
        return qwen3_5_moe_text_only_config(dims, torch_dtype)
    raise ValueError(f"unknown layout {layout!r}: expected 'hub' or 'per-expert'")
