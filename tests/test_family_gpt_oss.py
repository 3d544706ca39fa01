"""gpt-oss streamed: tiny random checkpoints in its three layouts (transformers' float
layout, the official release's native mxfp4 experts, an MLX 4-bit conversion) with what
makes the family: expert biases streamed with their experts, the clamped SwiGLU, a router
with bias (top-k, then softmax over the k), attention sinks and q/k/v/o biases, sliding
window layers (a window of 4: the prompt and decode run past it, the rotating caches wrap)
alternating with full ones, YaRN; against mlx-lm's resident gpt_oss and transformers'
GptOssForCausalLM; served with the harmony chat format, its channels and tool calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from helpers_engine import engine_config, generate
from helpers_family import (
    PROMPT,
    assert_bit_identical_across_pools,
    batch_of_two_greedy,
    parse_streamed,
    served_tool_round_trip,
    tiny_pair,
)
from helpers_forward import DirectForward, greedy_reference
from mlx_lm.models.base import create_attention_mask

from pipeline.engine import open_engine
from qpack.reader import Container
from qpack.synth.presets import get_preset
from qpack.synth.tokenizer import TokenizerSpec

FAMILY = "gpt_oss"
_REFS: dict[tuple[Path, int | None], GptOssReference] = {}


class GptOssReference:
    """mlx-lm's gpt_oss Model over `src`, every expert resident. mlx-lm 0.32 loads the MLX
    and mxfp4 layouts itself; transformers' float layout ([E, H, 2I] gate_up, [E, I, H]
    down) its sanitize does not read (ml-explore/mlx-lm#1079: no `.weight`, no transpose),
    so those weights get that issue's fix here: transposed, then split even/odd as
    mlx-lm's sanitize splits the mxfp4 rows."""

    def __init__(self, src: Path, quantize: int | None = None) -> None:
        from mlx_lm.utils import _get_classes, load_config, load_model, quantize_model

        names = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        if not any(n.endswith("experts.gate_up_proj") for n in names):
            self.model, _ = load_model(src)
        else:
            config = load_config(src)
            model_class, args_class = _get_classes(config)
            self.model = model_class(args_class.from_dict(config))
            weights: dict[str, mx.array] = {}
            for f in sorted(src.glob("*.safetensors")):
                weights.update(mx.load(str(f)))
            self.model.load_weights(list(_sanitize_float(weights).items()))
            if quantize is not None:
                self.model, _ = quantize_model(self.model, config, group_size=64, bits=quantize)
        self.model.eval()
        mx.eval(self.model.parameters())

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def forward(self, tokens: Sequence[int], cache: list[Any]) -> tuple[mx.array, list[mx.array]]:
        """GptOssMoeModel.__call__ keeping each layer's output: (last logits, outputs)."""
        d = self.model.model
        h = d.embed_tokens(mx.array([list(tokens)]))
        full = create_attention_mask(h, cache[d.ga_idx])
        swa = create_attention_mask(h, cache[d.swa_idx], window_size=d.window_size)
        outputs = []
        for layer, c, kind in zip(d.layers, cache, d.layer_types, strict=True):
            h = layer(h, full if kind == "full_attention" else swa, c)
            mx.eval(h)
            outputs.append(h)
        return self.model.lm_head(d.norm(h[:, -1:]))[0], outputs

    def logits(self, tokens: Sequence[int], cache: list[Any]) -> mx.array:
        out = self.model(mx.array([list(tokens)]), cache=cache)[0, -1]
        mx.eval(out)
        return out


def _sanitize_float(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_up_proj"):
            v = v.swapaxes(-1, -2)
            out[k.replace("gate_up_proj", "gate_proj.weight")] = mx.contiguous(v[..., ::2, :])
            out[k.replace("gate_up_proj", "up_proj.weight")] = mx.contiguous(v[..., 1::2, :])
        elif k.endswith("experts.down_proj"):
            out[k + ".weight"] = mx.contiguous(v.swapaxes(-1, -2))
        elif k.endswith("gate_up_proj_bias"):
            out[k.replace("gate_up_proj_bias", "gate_proj.bias")] = mx.contiguous(v[..., ::2])
            out[k.replace("gate_up_proj_bias", "up_proj.bias")] = mx.contiguous(v[..., 1::2])
        else:
            out[k.replace("down_proj_bias", "down_proj.bias")] = v
    return out


def reference(src: Path, quantize: int | None = None) -> GptOssReference:
    if (src, quantize) not in _REFS:
        _REFS[(src, quantize)] = GptOssReference(src, quantize)
    return _REFS[(src, quantize)]


@pytest.fixture
def pair(synth_checkpoint, packed):
    """(source, container, bits the reference quantizes at) by kind: fp32 (transformers'
    layout, float experts), bf16-q4 (bf16 packed at 4 bits, affine), mlx-mxfp4 (what
    mlx_lm.convert -q --q-mode mxfp4 writes, as mlx-community's gpt-oss conversions are),
    mxfp4 (the official release's layout: native mxfp4 experts, copied; its dense tensors
    in float32 here, as the engine computes in float32 on the CPU: mlx-lm's resident
    model then does too, and bf16 dense is what bf16-q4 and mlx-mxfp4 run)."""
    def make(kind: str) -> tuple[Path, Path, int | None]:
        if kind in ("fp32", "bf16-q4"):  # as every family's
            return tiny_pair(synth_checkpoint, packed, FAMILY, kind)
        if kind == "mlx-mxfp4":  # mlx_lm.convert -q --q-mode mxfp4 (router at 8 bits, affine)
            src = synth_checkpoint(FAMILY, dtype="bfloat16", bits=4, mode="mxfp4")
            return src, packed(src), None
        src = synth_checkpoint(FAMILY, dtype="float32", layout="mxfp4")
        return src, packed(src), None

    return make


def test_the_release_layout_keeps_its_mxfp4_experts_byte_for_byte_and_the_rest_dense(pair):
    src, qpack, _ = pair("mxfp4")
    config = json.loads((src / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.1.mlp.experts.gate_up_proj_blocks", "model.layers.1.mlp.experts.down_proj_scales",
            "model.layers.1.mlp.experts.gate_up_proj_bias", "model.layers.1.self_attn.sinks",
            "model.layers.1.self_attn.o_proj.bias", "model.layers.1.mlp.router.bias"} <= set(index)
    with Container.open(qpack) as c:
        m = c.manifest
        assert (m.model_type, m.num_layers, m.num_experts, m.top_k) == (FAMILY, 4, 16, 4)
        assert [e.index for e in m.layers] == [0, 1, 2, 3]  # every layer routes
        fmt = m.layer(1).format
        assert (fmt.bits, fmt.group_size, fmt.mode) == (4, 32, "mxfp4")
        assert {t.name for t in fmt.tensors} == {f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj")
                                                for k in ("weight", "scales", "bias")}
        buf = np.empty(m.layer(1).stride, dtype=np.uint8)
        c.read_expert(1, 5, buf)
        dense = mx.load(str(c.dense_path))
    shard = src / index["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    blocks = np.array(mx.load(str(shard))["model.layers.1.mlp.experts.gate_up_proj_blocks"])[5]
    t = fmt.tensor("up_proj.weight")  # the odd rows of the interleaved gate/up, as mlx-lm reads them
    assert buf[t.offset : t.offset + t.nbytes].tobytes() == np.ascontiguousarray(blocks[1::2]).tobytes()
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    scales = np.array(mx.load(str(src / index[name]))[name])[5]
    t = fmt.tensor("gate_proj.scales")
    assert buf[t.offset : t.offset + t.nbytes].tobytes() == np.ascontiguousarray(scales[0::2]).tobytes()
    assert dense["model.layers.1.self_attn.sinks"].dtype == mx.float32
    assert "model.layers.1.mlp.router.weight" in dense and "model.layers.1.mlp.experts.gate_proj.bias" not in dense


@pytest.mark.parametrize("kind", ["fp32", "bf16-q4", "mlx-mxfp4", "mxfp4"])
def test_every_layer_and_the_logits_equal_mlx_lm(pair, kind):
    """A prompt past the window, then decode steps: every layer's output and the logits
    are mlx-lm's, bit for bit."""
    src, qpack, quantize = pair(kind)
    ref = reference(src, quantize)
    assert type(ref.model).__module__ == "mlx_lm.models.gpt_oss"
    ours = DirectForward(qpack, num_slots=16, seed=1)
    mine, theirs = ours.make_cache(), ref.make_cache()
    assert [type(c).__name__ for c in mine] == ["RotatingKVCache", "KVCache"] * 2
    for tokens in (PROMPT, [5], [4242], [77], [9]):
        logits, layers = ours.forward(tokens, mine, layer_outputs=True, all_positions=False)
        want_logits, want_layers = ref.forward(tokens, theirs)
        for i, (got, want) in enumerate(zip(layers, want_layers, strict=True)):
            assert mx.array_equal(got, want).item(), f"layer {i}, tokens {tokens}"
        assert mx.array_equal(logits, want_logits).item(), f"logits, tokens {tokens}"
    assert ours.installs > 0
    ours.close()


def test_logits_bit_identical_across_pool_sizes_and_slot_assignments(pair):
    _src, qpack, _ = pair("mxfp4")
    assert_bit_identical_across_pools(qpack, 4, top_k=4)


def test_forced_routing_weighs_the_ids_as_the_router_would(pair):
    _src, qpack, _ = pair("mlx-mxfp4")
    ours = DirectForward(qpack)
    block = ours.model.parts.layers[1]
    x = mx.random.normal((1, 5, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    inds, scores = ours.model.family.route(block.mlp, x)
    forced_inds, forced_scores = ours.model.family.route(block.mlp, x, forced=inds)
    assert mx.array_equal(forced_inds, inds).item() and mx.array_equal(forced_scores, scores).item()
    # Next-gate ranks the router's logits: their top-k is the choice.
    top = mx.argpartition(ours.model.router_logits(1, x.reshape(-1, 64)), kth=-4, axis=-1)[..., -4:]
    assert mx.array_equal(mx.sort(top, axis=-1), mx.sort(inds.reshape(-1, 4), axis=-1)).item()
    ours.close()


def test_logits_match_transformers(pair, tmp_path):
    """transformers' GptOssForCausalLM in fp32, every position. mlx-lm 0.32's YaRN always
    rounds the correction range (transformers' `truncate: true`); the hub config says
    false, which transformers reads and mlx-lm does not (5e-3 apart on this model): the
    comparison runs transformers on the config mlx-lm computes."""
    torch = pytest.importorskip("torch")
    import transformers

    src, qpack, _ = pair("fp32")
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["rope_scaling"]["truncate"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = DirectForward(qpack)
    got = np.array(ours.forward(PROMPT, ours.make_cache())[0])
    ours.close()
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
    assert got.shape == want.shape
    assert float(np.max(np.abs(got - want))) <= 1e-4


async def test_two_prompts_in_one_batch_get_mlx_lm_greedy_with_lookahead_and_direct_readers(pair):
    """The real engine, two layers of router predictions ahead, four O_DIRECT readers, 16
    slots: two prompts decoded in one batch (rotating and plain KV caches merged) each get
    mlx-lm's greedy tokens for the prompt alone. Next-gate runs in the served test."""
    src, qpack, _ = pair("mxfp4")
    got, want, eos, largest = await batch_of_two_greedy(qpack, reference(src))
    ids = TokenizerSpec("gpt_oss", ranks=get_preset("gpt_oss", "tiny").bpe_ranks)
    assert {ids.token_id(200002), ids.token_id(200012)} <= eos  # <|return|>, <|call|>
    assert got == want
    assert largest == 2


def test_the_bench_container_verifies_and_runs(tmp_path):
    from qpack.reader import verify_container
    from qpack.synth.bench_container import write_bench_container

    out = write_bench_container(tmp_path / "bench.qpack", FAMILY, "tiny", seed=3).path
    report = verify_container(out)
    assert report.ok, report.problems
    with Container.open(out) as c:  # the experts' biases too: mlx-lm's resident model needs them
        assert "down_proj.bias" in {t.name for t in c.manifest.layer(0).format.tensors}
    ours = DirectForward(out, num_slots=16)
    logits = ours.forward(PROMPT, ours.make_cache(), all_positions=False)[0]
    ours.close()
    assert logits.shape == (1, get_preset("gpt_oss", "tiny").vocab_size) and bool(mx.all(mx.isfinite(logits)).item())


async def test_served_tool_calls_and_reasoning_in_harmony(pair):
    src, qpack, _ = pair("mxfp4")
    prompt = await served_tool_round_trip(qpack, src)
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
                             "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ")
    assert ("<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
            "// Current weather for a city\ntype get_weather = (_: {\ncity: string,\ndays?: number,\n"
            "}) => any;\n\n} // namespace functions<|end|>") in prompt
    assert ('<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant to=functions.'
            'get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>') in prompt
    assert prompt.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                           '"18 degrees and sunny"<|end|><|start|>assistant')
    out = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>"
           "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}")
    reasoning, content, calls = parse_streamed(qpack, out, in_reasoning=False)
    assert (reasoning, content) == ("The user wants weather.", "")
    assert calls == [("get_weather", {"city": "Paris", "days": 2})]
    out = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
           "It is 18 degrees.<|return|>")
    assert parse_streamed(qpack, out, in_reasoning=False) == ("Easy.", "It is 18 degrees.", [])


async def test_a_follow_up_reuses_the_prefix_with_its_rotating_caches(pair, tmp_path):
    """The memory prefix cache keeps a ring whole (buffer and wrap point): a follow-up that
    starts with the first turn gets mlx-lm's tokens for the whole prompt. A speculative
    request verifies drafts over the rings (the same tokens: tests/test_verify_sliding.py
    has the bit-for-bit checks); the routing trace holds every layer of every step."""
    from actors.sampling_params import SamplingParams
    from pipeline.engine_hooks import emulate_drafts
    from pipeline.speculation import EmulatedDrafts

    src, qpack, _ = pair("mxfp4")
    async with open_engine(engine_config(qpack, pool={"slots": 16}), record_routing=True) as engine:
        eos = set(engine.tokenizer.eos_token_ids)
        first = await generate(engine, PROMPT, 4)
        longer = [*PROMPT, *first.token_ids, 5, 6]
        again = await generate(engine, longer, 4)
        assert again.stats.cached_tokens >= len(PROMPT)
        assert list(again.token_ids) == greedy_reference(reference(src), longer, 4, eos, chunk=2)
        engine.prefix_cache.clear()
        emulate_drafts(engine, EmulatedDrafts(first.token_ids, 0.6, seed=2))
        greedy = SamplingParams(temperature=0.0, max_tokens=4, speculative="ngram")
        spec = [e async for e in engine.generate(PROMPT, greedy)][-1]
        assert spec.token_ids == first.token_ids and spec.stats.verify_passes > 0
        steps = engine._core.compute.recorder.trace.steps
        assert steps and all([e.layer for e in st.layers] == [0, 1, 2, 3] for st in steps)


def test_a_wrapped_ring_stored_on_disk_continues_bit_for_bit(pair, tmp_path):
    """The disk prefix cache keeps a ring as it lies and where it wraps (`_idx`): loaded
    into fresh caches, the next steps' logits equal the uninterrupted run's."""
    from pipeline.prefix_disk import encode_state, load_state, read_header

    _src, qpack, _ = pair("mxfp4")
    ours = DirectForward(qpack)
    cache = ours.make_cache()
    for tokens in (PROMPT, [5], [4242]):  # 15 positions through a window of 4: wrapped
        ours.forward(tokens, cache, all_positions=False)
    assert cache[0].offset == 15 and 0 < cache[0]._idx < cache[0].max_size
    path = tmp_path / "state.bin"
    path.write_bytes(b"".join(encode_state("fp", [1] * 15, cache)))
    header, start = read_header(path)
    loaded = load_state(path, header, start, ours.make_cache())
    for token in (77, 9):
        want = ours.forward([token], cache, all_positions=False)[0]
        assert mx.array_equal(ours.forward([token], loaded, all_positions=False)[0], want).item()
    ours.close()


def test_harmony_output_in_every_shape_the_model_writes_it():
    """Through the server's parser, whole and one character at a time (the same parts):
    the recipient in the role header (as the released template renders calls) or after the
    channel; a preamble on commentary is content; two calls; a body that is no JSON object
    stays visible; without tools a call's text is content; plain text stays plain."""
    from pipeline.server.tool_calls import OutputParser, parse_output

    def calls(out: Any) -> list[tuple[str, dict]]:
        return [(c.name, json.loads(c.arguments)) for c in out.calls]

    header = ("<|channel|>analysis<|message|>Two cities.<|end|><|start|>assistant to=functions.get_weather"
              "<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>")
    out = parse_output(header)
    assert (out.reasoning, out.content, calls(out)) == ("Two cities.", None, [("get_weather", {"city": "Paris"})])
    two = ("<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary "
           "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|><|start|>assistant"
           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Rome\"}")
    out = parse_output(two)
    assert out.content == "Checking both."
    assert calls(out) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert [c.index for c in out.calls] == [0, 1]
    streamed = OutputParser()
    parts = [p for ch in two for p in streamed.feed(ch)] + streamed.finish()
    assert [p.name for p in parts if hasattr(p, "name")] == ["get_weather", "get_weather"]
    assert "".join(p.text for p in parts if type(p).__name__ == "Content") == "Checking both."
    broken = parse_output("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{oops")
    assert (broken.content, broken.calls) == ("{oops", [])
    untooled = parse_output("<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Paris\"}",
                            tools=False)
    assert (untooled.content, untooled.calls) == ('{"city": "Paris"}', [])
    assert parse_output("Plain text, no channels.").content == "Plain text, no channels."


def test_the_template_keeps_the_analysis_before_a_call_until_a_final_answer():
    """As the released template: the system message takes `reasoning_effort`, a system
    message becomes the developer's instructions, an earlier turn's reasoning is dropped,
    and the reasoning before a tool call is kept only while no final answer follows it."""
    from pipeline.template_render import render
    from qpack.families import family

    template = family(FAMILY).chat_template("harmony")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
             {"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [call]},
             {"role": "tool", "content": "sunny"}]
    text = render(template, turns, add_generation_prompt=True, reasoning_effort="high")
    assert "Reasoning: high\n\n# Valid channels: analysis, commentary, final." in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>" in text
    assert "Greet back." not in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant "
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in text
    done = render(template, [*turns, {"role": "assistant", "content": "Sunny."}], add_generation_prompt=True)
    assert "Call the tool." not in done and done.endswith("<|message|>Sunny.<|end|><|start|>assistant")
