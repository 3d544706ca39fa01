"""Qwen3 MoE (Qwen3-30B-A3B / 235B-A22B / Coder) streamed: tiny random checkpoints in the
hub layout, packed from fp32, from bf16 at 4 bits and from an MLX 4-bit conversion, against
mlx-lm's resident qwen3_moe and transformers' Qwen3MoeForCausalLM; served with Qwen3's
chat template and tool calls."""

from __future__ import annotations

import json

import pytest
from helpers_family import (
    TOLERANCE,
    assert_bit_identical_across_pools,
    assert_close_to_transformers,
    assert_engine_greedy_with_lookahead,
    assert_layers_and_logits_match,
    parse_streamed,
    reference,
    served_tool_round_trip,
    tiny_pair,
)

from qpack.reader import Container

FAMILY = "qwen3_moe"


@pytest.fixture
def pair(synth_checkpoint, packed):
    return lambda kind: tiny_pair(synth_checkpoint, packed, FAMILY, kind)


def test_hub_layout_is_per_expert_and_the_router_stays_dense(pair):
    src, qpack, _ = pair("fp32")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in index
    assert "model.layers.1.self_attn.q_norm.weight" in index and "model.layers.0.mlp.gate.weight" in index
    assert not any("shared_expert" in name for name in index)
    with Container.open(qpack) as c:
        m = c.manifest
        assert (m.model_type, m.num_experts, m.top_k, [e.index for e in m.layers]) == (FAMILY, 16, 4, [0, 1])


@pytest.mark.parametrize("kind", ["fp32", "bf16-q4", "mlx-q4"])
def test_every_layer_and_the_logits_match_mlx_lm(pair, kind):
    src, qpack, quantize = pair(kind)
    ref = reference(src, quantize)
    assert type(ref.model).__module__ == "mlx_lm.models.qwen3_moe"
    assert_layers_and_logits_match(qpack, ref, TOLERANCE[4 if kind != "fp32" else None])


def test_logits_bit_identical_across_pool_sizes_and_slot_assignments(pair):
    """Chunks of 16 tokens route 64 (token, expert) pairs: the sorted gather_qmm path too."""
    _src, qpack, _ = pair("mlx-q4")
    assert_bit_identical_across_pools(qpack, 16, top_k=4)


async def test_engine_greedy_equals_mlx_lm_with_lookahead_and_four_direct_readers(pair):
    """Next-gate runs in the served test."""
    src, qpack, _ = pair("fp32")
    await assert_engine_greedy_with_lookahead(src, qpack)


def test_logits_match_transformers(pair):
    src, qpack, _ = pair("fp32")
    assert_close_to_transformers(src, qpack, "Qwen3MoeForCausalLM")


async def test_served_tool_calls_and_reasoning_in_qwen3_markup(pair):
    src, qpack, _ = pair("fp32")
    prompt = await served_tool_round_trip(qpack, src, forced=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")  # the hybrid model opens <think> itself
    out = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
    reasoning, content, calls = parse_streamed(qpack, out, in_reasoning=False)
    assert (reasoning, content) == ("The user wants weather.", "Let me check.")
    assert calls == [("get_weather", {"city": "Paris", "days": 2})]
