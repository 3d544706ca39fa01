"""The dimensions of one synthetic model: everything that sets its tensor shapes and config.

One struct for every family: the fields a family does not have keep their defaults (a
full-attention family has no Gated DeltaNet heads, a family without shared experts a
shared width of 0). Each family module (qpack/families) lists its presets in these terms.
"""

from __future__ import annotations

import msgspec


class ModelDims(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    family: str
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    shared_expert_intermediate_size: int = 0
    linear_num_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 1  # 1: full attention in every layer (no DeltaNet)
    intermediate_size: int = 5120  # the dense MLP's width (dense layers; unused if none)
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    first_dense_layers: int = 0  # leading layers with a dense MLP instead of experts (GLM)
    n_shared_experts: int = 0  # shared experts of moe_intermediate_size each (GLM)
    n_group: int = 1  # grouped top-k routing (GLM / DeepSeek): groups, and groups kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    use_qk_norm: bool = False
    # Multi-head latent attention (DeepSeek-V3 / Kimi-K2); 0: the family has none.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0  # gpt-oss: the window of its sliding-attention layers (0: none)
    # The tokenizer's BPE ranks, its added tokens after them (0: the family's own). The
    # tiny presets keep 8,192: their output head is most of a token's work on a CPU
    # (qpack/synth/tokenizer.py TokenizerSpec).
    bpe_ranks: int = 0

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
        """Gated DeltaNet layer (True) or full attention (False), as mlx-lm and transformers decide."""
        return (layer + 1) % self.full_attention_interval != 0

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense_layers

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
            "num_attention_heads*head_dim": self.num_attention_heads * self.head_dim,
        }
        if self.shared_expert_intermediate_size:
            inputs["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.first_dense_layers:
            inputs["intermediate_size"] = self.intermediate_size
        if self.full_attention_interval > 1:
            inputs["linear value dim"] = self.value_dim
        if self.kv_lora_rank:  # MLA's Linears and its per-head up-projections (embed_q, unembed_out)
            inputs.update(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                          qk_nope_head_dim=self.qk_nope_head_dim)
        for what, value in inputs.items():
            if value % 64:
                raise ValueError(
                    f"preset {self.family}/{self.name}: {what}={value} is the input dim of a "
                    "Linear and must be a multiple of 64 for group-64 quantization"
                )
        if self.full_attention_interval > 1 and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"preset {self.family}/{self.name}: linear_num_value_heads must be a multiple "
                "of linear_num_key_heads"
            )
