"""GLM-4.5 / 4.6 / 4.5-Air streamed: tiny random checkpoints in the hub layout (a dense
first layer, shared experts, a sigmoid router with correction bias and grouped top-k,
routed scaling, partial rotary, attention biases, q/k norms), packed from fp32, from bf16
at 4 bits and from an MLX 4-bit conversion, against mlx-lm's resident glm4_moe and
transformers' Glm4MoeForCausalLM; served with GLM's chat template and tool-call markup."""

from __future__ import annotations

import json

import mlx.core as mx
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
from helpers_forward import DirectForward

from qpack.names import target_name
from qpack.reader import Container

FAMILY = "glm4_moe"


@pytest.fixture
def pair(synth_checkpoint, packed):
    return lambda kind: tiny_pair(synth_checkpoint, packed, FAMILY, kind)


def test_dense_layers_shared_experts_and_router_bias_stay_in_the_dense_core(pair):
    src, qpack, _ = pair("fp32")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.gate_proj.weight" in index and "model.layers.0.mlp.experts.0.up_proj.weight" not in index
    assert {"model.layers.1.mlp.experts.15.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.1.self_attn.q_proj.bias", "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(index)
    with Container.open(qpack) as c:
        m = c.manifest
        assert (m.model_type, m.num_layers, m.num_experts, m.top_k) == (FAMILY, 3, 16, 4)
        assert [e.index for e in m.layers] == [1, 2]  # only the MoE layers stream
        dense = mx.load(str(c.dense_path))
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in dense
    assert dense["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    # The hub's MTP layer is one more decoder layer; like mlx-lm's sanitize, the packer drops it.
    text = {"num_hidden_layers": 3}
    assert target_name(FAMILY, "model.layers.3.mlp.experts.0.up_proj.weight", text) is None
    assert target_name(FAMILY, "model.layers.2.mlp.gate.weight", text) == "model.layers.2.mlp.gate.weight"


@pytest.mark.parametrize("kind", ["fp32", "bf16-q4", "mlx-q4"])
def test_every_layer_and_the_logits_match_mlx_lm(pair, kind):
    src, qpack, quantize = pair(kind)
    ref = reference(src, quantize)
    assert type(ref.model).__module__ == "mlx_lm.models.glm4_moe"
    assert_layers_and_logits_match(qpack, ref, TOLERANCE[4 if kind != "fp32" else None])


def test_logits_bit_identical_across_pool_sizes_and_slot_assignments(pair):
    """Chunks of 16 tokens route 64 (token, expert) pairs: the sorted gather_qmm path too."""
    _src, qpack, _ = pair("mlx-q4")
    assert_bit_identical_across_pools(qpack, 16, top_k=4)


async def test_engine_greedy_equals_mlx_lm_with_lookahead_and_four_direct_readers(pair):
    """Next-gate runs in the served test."""
    src, qpack, _ = pair("fp32")
    await assert_engine_greedy_with_lookahead(src, qpack)


def test_forced_routing_weighs_the_ids_as_the_router_would(pair):
    """Calibrated routing replaces the ids; at the router's own ids its weights are the router's."""
    _src, qpack, _ = pair("fp32")
    ours = DirectForward(qpack)
    block = ours.model.parts.layers[1]
    x = mx.random.normal((1, 5, 64), key=mx.random.key(0))
    inds, scores = ours.model.family.route(block.mlp, x)
    forced_inds, forced_scores = ours.model.family.route(block.mlp, x, forced=inds)
    assert mx.array_equal(forced_inds, inds).item()
    assert float(mx.max(mx.abs(forced_scores - scores)).item()) <= 1e-6
    ours.close()


def test_logits_match_transformers(pair):
    src, qpack, _ = pair("fp32")
    assert_close_to_transformers(src, qpack, "Glm4MoeForCausalLM")


async def test_served_tool_calls_and_reasoning_in_glm_markup(pair):
    src, qpack, _ = pair("fp32")
    prompt = await served_tool_round_trip(qpack, src)
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert ("<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>") in prompt
    assert "<|observation|>\n<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|assistant|>")
    out = ("\n<think>The user wants weather.</think>\nLet me check.\n<tool_call>get_weather\n"
           "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
           "<arg_value>2</arg_value>\n</tool_call>")
    reasoning, content, calls = parse_streamed(qpack, out, in_reasoning=False)
    assert (reasoning, content) == ("The user wants weather.", "Let me check.")
    assert calls == [("get_weather", {"city": "Paris", "days": 2})]


def test_info_pool_advice_says_no_routing_statistics_are_published(pair, capsys):
    from pipeline.cli import main

    _src, qpack, _ = pair("mlx-q4")
    assert main(["info", str(qpack), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)["pool_advice"]
    assert advice["borrowed_for"] == FAMILY and advice["family"] == "qwen3.5-397b"
    assert f"borrowed: no published routing statistics for {FAMILY}" in advice["note"]
