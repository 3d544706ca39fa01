"""DeepSeek-V3.x / Kimi-K2 streamed: tiny random checkpoints in the hub layout (multi-head
latent attention with YaRN, a dense first layer, a shared expert, a sigmoid router with
correction bias and grouped top-k, routed scaling), packed from fp32, from bf16 at 4 bits and
from an MLX 4-bit conversion, against mlx-lm's resident deepseek_v3 and transformers'
DeepseekV3ForCausalLM; served with DeepSeek-V3.1's template and tool-call markup."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers_family import (
    PROMPT,
    TOLERANCE,
    assert_bit_identical_across_pools,
    assert_close_to_transformers,
    assert_layers_and_logits_match,
    batch_of_two_greedy,
    parse_streamed,
    reference,
    served_tool_round_trip,
    tiny_pair,
)
from helpers_forward import DirectForward
from mlx.utils import tree_flatten

from qpack.names import target_name
from qpack.reader import Container
from qpack.synth.presets import get_preset

FAMILY = "deepseek_v3"


@pytest.fixture
def pair(synth_checkpoint, packed):
    return lambda kind: tiny_pair(synth_checkpoint, packed, FAMILY, kind)


def test_mla_dense_layer_shared_expert_and_router_bias_stay_in_the_dense_core(pair):
    src, qpack, _ = pair("fp32")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
            "model.layers.1.self_attn.q_a_layernorm.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.2.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.experts.15.down_proj.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(index)
    with Container.open(qpack) as c:
        m = c.manifest
        assert (m.model_type, m.num_layers, m.num_experts, m.top_k) == (FAMILY, 4, 16, 4)
        assert [e.index for e in m.layers] == [1, 2, 3]  # only the MoE layers stream
        dense = mx.load(str(c.dense_path))
    # kv_b_proj [heads * (nope + v), rank] is cut as mlx-lm's sanitize cuts it.
    assert "model.layers.1.self_attn.kv_b_proj.weight" not in dense
    assert dense["model.layers.1.self_attn.embed_q.weight"].shape == (4, 64, 64)  # [heads, rank, nope]
    assert dense["model.layers.1.self_attn.unembed_out.weight"].shape == (4, 128, 64)  # [heads, v, rank]
    assert dense["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in dense
    # A sequence's cache: one latent and one rotary key per position, shared by the heads.
    ours = DirectForward(qpack)
    assert ours.model.state_bytes(256) == 4 * 256 * (64 + 16) * 4  # 4 layers
    ours.close()
    # The hub's MTP layer is one more decoder layer: dropped, like mlx-lm's sanitize.
    text = {"num_hidden_layers": 3}
    assert target_name(FAMILY, "model.layers.3.mlp.experts.0.up_proj.weight", text) is None
    assert target_name("kimi_k2", "model.layers.2.mlp.gate.weight", text) == "model.layers.2.mlp.gate.weight"


@pytest.mark.parametrize("kind", ["fp32", "bf16-q4", "mlx-q4"])
def test_every_layer_and_the_logits_match_mlx_lm(pair, kind):
    src, qpack, quantize = pair(kind)
    ref = reference(src, quantize)
    assert type(ref.model).__module__ == "mlx_lm.models.deepseek_v3"
    assert_layers_and_logits_match(qpack, ref, TOLERANCE[4 if kind != "fp32" else None])


def test_logits_bit_identical_across_pool_sizes_and_slot_assignments(pair):
    """Chunks of 16 tokens route 64 (token, expert) pairs: the sorted gather_qmm path too."""
    _src, qpack, _ = pair("mlx-q4")
    assert_bit_identical_across_pools(qpack, 16, top_k=4)


async def test_two_prompts_in_one_batch_get_mlx_lm_greedy_with_lookahead_and_direct_readers(pair):
    """The real engine, two layers of router predictions ahead, four O_DIRECT readers, 16
    slots (every step misses): two prompts decoded in one batch (the MLA caches merged and
    masked as arrays) each get mlx-lm's greedy tokens for the prompt alone. Next-gate runs
    in the served test."""
    src, qpack, _ = pair("fp32")
    got, want, eos, largest = await batch_of_two_greedy(qpack, reference(src))
    assert got == want
    assert largest == 2


def test_logits_match_transformers(pair):
    src, qpack, _ = pair("fp32")
    assert_close_to_transformers(src, qpack, "DeepseekV3ForCausalLM")


def test_the_official_fp8_layout_packs_to_its_dequantized_weights(synth_checkpoint, tmp_path):
    """DeepSeek's releases are FP8 block-scaled, kv_b_proj too: dequantized, then cut."""
    from test_fp8 import _expected

    from qpack.families.deepseek_v3 import split_kv_b
    from qpack.synth.wild import derive
    from qpack.writer import pack

    wild = derive(synth_checkpoint(FAMILY, dtype="bfloat16"), tmp_path / "fp8", "fp8-block")
    out = pack(wild, tmp_path / "fp8.qpack", bits=16, progress=False).path
    with Container.open(out) as c:
        dense = mx.load(str(c.dense_path))
    kv_b = _expected(wild, "model.layers.2.self_attn.kv_b_proj.weight", None)
    text = {"num_attention_heads": 4, "qk_nope_head_dim": 64, "v_head_dim": 128}
    for part in ("embed_q", "unembed_out"):
        got = np.array(dense[f"model.layers.2.self_attn.{part}.weight"].astype(mx.float32))
        np.testing.assert_array_equal(got, split_kv_b(kv_b, f"self_attn.{part}.weight", text))
    got = np.array(dense["model.layers.2.self_attn.q_b_proj.weight"].astype(mx.float32))
    np.testing.assert_array_equal(got, _expected(wild, "model.layers.2.self_attn.q_b_proj.weight", None))


def test_the_bench_container_verifies_and_runs(tmp_path):
    """`bench-container` writes the MLX layout's dense core (kv_b_proj already cut) beside
    random 4-bit experts: it verifies, loads into mlx-lm's model and gives finite logits."""
    from qpack.reader import verify_container
    from qpack.synth.bench_container import write_bench_container

    out = write_bench_container(tmp_path / "bench.qpack", FAMILY, "tiny", seed=3).path
    report = verify_container(out)
    assert report.ok, report.problems
    ours = DirectForward(out, num_slots=16)
    logits = ours.forward(PROMPT, ours.make_cache())[0]
    ours.close()
    assert logits.shape == (len(PROMPT), get_preset(FAMILY, "tiny").vocab_size) and bool(mx.all(mx.isfinite(logits)).item())


def _old_mlx_conversion(new: Path, hf: Path, out: Path) -> Path:
    """What mlx_lm.convert wrote before its MultiLinear split (every mlx-community DeepSeek
    conversion of 2025): kv_b_proj quantized whole, at the conversion's 4 bits, group 64."""
    import shutil

    shutil.copytree(new, out)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    hf_index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map = index["weight_map"]
    for shard in sorted(set(weight_map.values())):
        tensors = mx.load(str(out / shard))
        cut = [n for n in tensors if ".embed_q." in n or ".unembed_out." in n]
        for base in sorted({n.split(".self_attn.")[0] for n in cut}):
            name = base + ".self_attn.kv_b_proj.weight"
            w = mx.load(str(hf / hf_index[name]))[name]
            for part, arr in zip(("weight", "scales", "biases"), mx.quantize(w, group_size=64, bits=4), strict=True):
                tensors[f"{base}.self_attn.kv_b_proj.{part}"] = arr
                weight_map[f"{base}.self_attn.kv_b_proj.{part}"] = shard
        for n in cut:
            del tensors[n], weight_map[n]
        mx.save_safetensors(str(out / shard), tensors, metadata={"format": "mlx"})
    index_path.write_text(json.dumps(index))
    return out


def test_an_old_mlx_conversion_with_kv_b_proj_quantized_whole_packs_as_mlx_lm_loads_it(
        synth_checkpoint, packed, tmp_path_factory):
    """mlx-lm dequantizes kv_b_proj, cuts it and quantizes the parts again; so does the packer,
    to the same bits: the dense core is mlx-lm's model's, and so are the logits."""
    old = _old_mlx_conversion(synth_checkpoint(FAMILY, dtype="bfloat16", bits=4),
                              synth_checkpoint(FAMILY, dtype="bfloat16"), tmp_path_factory.mktemp("old") / "old")
    ref = reference(old)
    qpack = packed(old)
    with Container.open(qpack) as c:
        dense = mx.load(str(c.dense_path))
    assert not [n for n in dense if "kv_b_proj" in n]
    want = dict(tree_flatten(ref.model.parameters()))
    for part in ("embed_q", "unembed_out"):
        for kind in ("weight", "scales", "biases"):
            name = f"model.layers.1.self_attn.{part}.{kind}"
            assert mx.array_equal(dense[name], want[name]).item(), name
    assert_layers_and_logits_match(qpack, ref, TOLERANCE[4])


def test_the_template_thinks_when_asked_and_keeps_only_earlier_answers():
    """V3.1 answers directly (`</think>`) unless `thinking` (the released template's switch)
    or `enable_thinking` is true; an earlier answer keeps what follows its </think>."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from qpack.families import family

    template = _compile_jinja_template(family(FAMILY).chat_template("hybrid"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Greeting.</think>Hello!"}, {"role": "user", "content": "2+2?"}]

    def render(**kwargs: bool) -> str:
        return template.render(messages=messages, bos_token="<BOS>", add_generation_prompt=True, **kwargs)

    assert render() == ("<BOS>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>"
                        "<｜User｜>2+2?<｜Assistant｜></think>")
    assert render(thinking=True).endswith("<｜User｜>2+2?<｜Assistant｜><think>")
    assert render(enable_thinking=True).endswith("<｜Assistant｜><think>")


def test_a_template_that_joins_arguments_as_text_gets_json_text(pair):
    """DeepSeek-V3.1's released template writes `name + '<｜tool▁sep｜>' + arguments`, which
    a mapping (the transformers convention, what the server hands templates) cannot join:
    the server renders such a template with the arguments as JSON text."""
    from transformers import AutoTokenizer

    from pipeline.server.prompting import render

    _src, qpack, _ = pair("fp32")
    tok = AutoTokenizer.from_pretrained(qpack)
    tok.chat_template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                         "{{ '<｜tool▁call▁begin｜>' + c.function.name + '<｜tool▁sep｜>' + c.function.arguments"
                         " + '<｜tool▁call▁end｜>' }}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    prompt = render(tok, messages, [], {})
    assert prompt.text == 'Weather?<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>sunny'


async def test_served_tool_calls_and_reasoning_in_deepseek_markup(pair):
    src, qpack, _ = pair("fp32")
    prompt = await served_tool_round_trip(qpack, src)
    assert prompt.startswith("<｜begin▁of▁sentence｜>## Tools\nYou have access to the following tools:\n\n"
                             "### get_weather\nDescription: Current weather for a city")
    assert ("<｜User｜>What is the weather in Paris?<｜Assistant｜></think><｜tool▁calls▁begin｜>"
            '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
            "<｜tool▁output▁begin｜>18 degrees and sunny<｜tool▁output▁end｜>") in prompt
    assert prompt.endswith("<｜tool▁output▁end｜>")  # the model goes on after a result
    out = ("The user wants weather.</think>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
           'get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>'
           'get_weather<｜tool▁sep｜>{"city": "Lyon"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    reasoning, content, calls = parse_streamed(qpack, out, in_reasoning=True)
    assert (reasoning, content) == ("The user wants weather.", "Let me check.")
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon"})]


async def test_served_kimi_k2_tool_calls_in_its_own_markup(synth_checkpoint, packed):
    """Kimi-K2 (deepseek_v3's architecture, the kimi-tiny preset: Kimi's routing, its
    tokenizer's 163840 ids, its template): tools declared in the `tool_declare` turn, calls
    in `<|tool_calls_section_begin|>` and results as `## Return of ID`, forced calls in
    Kimi's own markup through the official clients. The greedy batch is left out (~3 s):
    the forward pass is DeepSeek's, served greedy above."""
    from pipeline.engine_parts import cached_tokenizer

    src = synth_checkpoint(FAMILY, dtype="float32", preset="kimi-tiny")
    with Container.open(packed(src, bits=16)) as c:
        tok = cached_tokenizer(c.tokenizer_dir())
    # Kimi's ids (tokenizer_config.json), its turns ending at <|im_end|> (generation_config)
    # as well as [EOS], and its split pattern keeping Han runs apart from Latin letters.
    ids = tok.encode("<|im_user|>user<|im_middle|>中文abc<|tool_call_argument_begin|>", add_special_tokens=False)
    assert (ids[0], ids[2], ids[-1]) == (163587, 163601, 163598)
    assert tok.eos_token_ids == {163585, 163586}
    assert not [t for t in map(tok.decode, ([i] for i in ids[3:-1])) if "中" in t and "a" in t]
    prompt = await served_tool_round_trip(packed(src, bits=16), src, greedy=False)
    assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":'
                             '{"name":"get_weather","description":"Current weather for a city"')
    assert ("<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
            "<|im_end|><|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>call_1"
            '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'
            "<|im_end|><|im_system|>tool<|im_middle|>## Return of call_1\n18 degrees and sunny<|im_end|>") in prompt
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    out = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
           '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
           'functions.get_weather:1<|tool_call_argument_begin|>{"city": "Lyon"}<|tool_call_end|>'
           "<|tool_calls_section_end|>")
    reasoning, content, calls = parse_streamed(packed(src, bits=16), out, in_reasoning=False)
    assert (reasoning, content) == ("", "Let me check.")
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon"})]
