"""Which initial distribution each synthetic tensor gets: scaled so activations keep a sane
size through the layers (random weights, real layouts)."""

from __future__ import annotations

import math

from qpack.synth.init_weights import NORM_STD, Init
from qpack.synth.presets import ModelDims


def dense_inits(dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
    """One decoder layer's tensors except the routed experts: (name under the text model, init)."""
    h, p = dims.hidden_size, f"layers.{layer}."
    res = 1.0 / math.sqrt(2 * dims.num_hidden_layers)

    def lin(name: str, out_dim: int, in_dim: int, scale: float = 1.0) -> tuple[str, Init]:
        return p + name, Init(p + name, (out_dim, in_dim), "normal", scale / math.sqrt(in_dim))

    def vec(name: str, n: int, mean: float, std: float) -> tuple[str, Init]:
        return p + name, Init(p + name, (n,), "normal", std, mean)

    out = [vec("input_layernorm.weight", h, 0.0, NORM_STD)]
    nv, kd, vd = dims.linear_num_value_heads, dims.key_dim, dims.value_dim
    if dims.is_linear(layer):
        if dims.family == "qwen3_next":
            out += [
                lin("linear_attn.in_proj_qkvz.weight", 2 * kd + 2 * vd, h),
                lin("linear_attn.in_proj_ba.weight", 2 * nv, h),
            ]
        else:
            out += [
                lin("linear_attn.in_proj_qkv.weight", 2 * kd + vd, h),
                lin("linear_attn.in_proj_z.weight", vd, h),
                lin("linear_attn.in_proj_b.weight", nv, h),
                lin("linear_attn.in_proj_a.weight", nv, h),
            ]
        k = dims.linear_conv_kernel_dim
        conv = p + "linear_attn.conv1d.weight"
        out += [
            (conv, Init(conv, (dims.conv_dim, 1, k), "normal", 1.0 / math.sqrt(k))),
            (p + "linear_attn.A_log", Init(p + "linear_attn.A_log", (nv,), "a_log")),
            vec("linear_attn.dt_bias", nv, -1.0, 0.5),
            vec("linear_attn.norm.weight", dims.linear_value_head_dim, 1.0, NORM_STD),
            lin("linear_attn.out_proj.weight", h, vd, res),
        ]
    else:
        q = dims.num_attention_heads * dims.head_dim
        kv = dims.num_key_value_heads * dims.head_dim
        out += [
            lin("self_attn.q_proj.weight", 2 * q, h),  # queries and their output gate
            lin("self_attn.k_proj.weight", kv, h),
            lin("self_attn.v_proj.weight", kv, h),
            lin("self_attn.o_proj.weight", h, q, res),
            vec("self_attn.q_norm.weight", dims.head_dim, 0.0, NORM_STD),
            vec("self_attn.k_norm.weight", dims.head_dim, 0.0, NORM_STD),
        ]
    si = dims.shared_expert_intermediate_size
    gate = p + "mlp.gate.weight"
    out += [
        vec("post_attention_layernorm.weight", h, 0.0, NORM_STD),
        (gate, Init(gate, (dims.num_experts, h), "router", 1.0, layer=layer)),
        lin("mlp.shared_expert.gate_proj.weight", si, h),
        lin("mlp.shared_expert.up_proj.weight", si, h),
        lin("mlp.shared_expert.down_proj.weight", h, si, res),
        lin("mlp.shared_expert_gate.weight", 1, h),
    ]
    return out


def expert_init(dims: ModelDims, layer: int, expert: int, proj: str) -> Init:
    h, i = dims.hidden_size, dims.moe_intermediate_size
    key = f"layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    if proj == "down_proj":
        res = 1.0 / math.sqrt(2 * dims.num_hidden_layers)
        return Init(key, (h, i), "normal", res / math.sqrt(i))
    return Init(key, (i, h), "normal", 1.0 / math.sqrt(h))
