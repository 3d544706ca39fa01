"""Test helpers for a family beyond the Qwen hybrids: mlx-lm's resident model run layer by
layer over the same checkpoint (any full-attention decoder), and the checks every family
runs against it (tests/test_family_<name>.py).

`FullAttentionReference.forward` is mlx-lm's `Model.__call__` with each layer's output
kept: embed, one causal mask from the first cache, the layers, norm, head.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from helpers_forward import DirectForward, greedy_reference, max_abs
from mlx_lm.models.base import create_attention_mask

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]
TOLERANCE = {None: 1e-4, 4: 2e-3}
_REFERENCES: dict[tuple[Path, int | None], FullAttentionReference] = {}


class FullAttentionReference:
    """mlx-lm's model over `src`, every expert resident (quantized in memory if asked)."""

    def __init__(self, src: Path, quantize: int | None = None) -> None:
        from mlx_lm.utils import load_model, quantize_model

        self.model, self.config = load_model(Path(src))
        if quantize is not None:
            self.model, self.config = quantize_model(self.model, self.config, group_size=64, bits=quantize)
        self.decoder = self.model.model
        # Whether mlx-lm's decoder builds its causal mask as an array (DeepSeek's MLA masks
        # its rotary scores itself): read from its own __call__, so the reference stays mlx-lm's.
        self.array_mask = "return_array=True" in inspect.getsource(type(self.decoder).__call__)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def forward(self, tokens: Sequence[int], cache: list[Any], *, layer_outputs: bool = False,
                all_positions: bool = True) -> tuple[mx.array, list[mx.array]]:
        d = self.decoder
        h = d.embed_tokens(mx.array([list(tokens)]))
        mask = create_attention_mask(h, cache[0], return_array=self.array_mask)
        outputs: list[mx.array] = []
        for layer, c in zip(d.layers, cache, strict=True):
            h = layer(h, mask, c)
            if layer_outputs:
                mx.eval(h)
                outputs.append(h)
        h = d.norm(h if all_positions else h[:, -1:])
        tied = getattr(self.model.args, "tie_word_embeddings", False)
        logits = (d.embed_tokens.as_linear(h) if tied else self.model.lm_head(h))[0]
        mx.eval(logits)
        return logits, outputs

    def logits(self, tokens: Sequence[int], cache: list[Any]) -> mx.array:
        out = self.model(mx.array([list(tokens)]), cache=cache)[0, -1]
        mx.eval(out)
        return out


def reference(src: Path, quantize: int | None = None) -> FullAttentionReference:
    if (src, quantize) not in _REFERENCES:
        _REFERENCES[(src, quantize)] = FullAttentionReference(src, quantize)
    return _REFERENCES[(src, quantize)]


def assert_layers_and_logits_match(qpack: Path, ref: FullAttentionReference, tol: float) -> None:
    """A prompt, then two decode steps on the caches it left: the layer outputs and the
    logits within `tol` of mlx-lm's; mlx-lm's own __call__ equals the layer-by-layer read."""
    ours = DirectForward(qpack, num_slots=16, seed=1)
    ours_cache, ref_cache = ours.make_cache(), ref.make_cache()
    for tokens in (PROMPT, [5], [4242]):
        logits, layers = ours.forward(tokens, ours_cache, layer_outputs=True, all_positions=False)
        want_logits, want_layers = ref.forward(tokens, ref_cache, layer_outputs=True, all_positions=False)
        n = ours.model.num_layers
        assert len(layers) == len(want_layers) == n
        # DirectForward sees the residual stream after each MoE layer's advance, up to the
        # next routing: the output of each layer before a later MoE layer, and of the last.
        moe = ours.model.moe_layers
        seen = [i for i in range(moe[0], n) if i + 1 in moe or i == n - 1]
        for i in seen:
            got, want = layers[i], want_layers[i]
            assert got.dtype == want.dtype
            assert max_abs(got, want) <= tol, f"layer {i} output, tokens {tokens}"
        assert max_abs(logits, want_logits) <= tol, f"logits, tokens {tokens}"
    assert mx.array_equal(ref.logits(PROMPT, ref.make_cache()),
                          ref.forward(PROMPT, ref.make_cache(), all_positions=False)[0][-1]).item()
    assert ours.installs > 0
    ours.close()


def run_chunks(qpack: Path, num_slots: int | None, seed: int, chunk: int) -> list[mx.array]:
    """Logits of each prefill chunk of PROMPT, then of four decode steps."""
    ours = DirectForward(qpack, num_slots=num_slots, seed=seed)
    cache = ours.make_cache()
    out = [ours.forward(PROMPT[i : i + chunk], cache, all_positions=False)[0]
           for i in range(0, len(PROMPT), chunk)]
    for token in (3, 141, 59, 26):
        out.append(ours.forward([token], cache)[0])
    ours.close()
    return out


def assert_bit_identical_across_pools(qpack: Path, chunk: int, top_k: int) -> None:
    """Smallest workable pool, a larger one, every expert resident: the same bits."""
    smallest = min(16, min(chunk, len(PROMPT)) * top_k)
    runs = [run_chunks(qpack, n, seed, chunk) for n, seed in ((smallest, 0), (smallest + 5, 7), (None, 3))]
    for n, run in enumerate(runs[1:], start=1):
        for i, (a, b) in enumerate(zip(runs[0], run, strict=True)):
            assert mx.array_equal(a, b).item(), f"run {n}, forward {i}"


def tiny_pair(synth_checkpoint: Any, packed: Any, family: str, kind: str) -> tuple[Path, Path, int | None]:
    """(source, container, bits to quantize the reference with) of the family's tiny preset:
    "fp32" (float experts: MLX CPU's gather_mm wants fp32), "bf16-q4" (bf16 packed at 4
    bits; mlx-lm quantizes its model the same way in memory), "mlx-q4" (what
    mlx_lm.convert -q writes, packed as it is)."""
    if kind == "fp32":
        src = synth_checkpoint(family, dtype="float32")
        return src, packed(src, bits=16), None
    if kind == "bf16-q4":
        src = synth_checkpoint(family, dtype="bfloat16")
        return src, packed(src, bits=4), 4
    src = synth_checkpoint(family, dtype="bfloat16", bits=4)
    return src, packed(src), None


async def assert_engine_greedy_with_lookahead(src: Path, qpack: Path) -> None:
    """The real engine at its smallest pool (8 slots: chunks of 2 tokens, top-4), two layers
    of router predictions ahead, four O_DIRECT readers: mlx-lm's greedy tokens."""
    from helpers_engine import engine_config, generate

    from pipeline.engine import open_engine

    cfg = engine_config(qpack, prefetch={"strategy": "lookahead", "depth": 2},
                        reader={"concurrency": 4, "o_direct": True})
    async with open_engine(cfg) as engine:
        want = greedy_reference(reference(src), PROMPT, 12, set(engine.tokenizer.eos_token_ids), chunk=2)
        assert list((await generate(engine, PROMPT, 12)).token_ids) == want
        assert engine.facts.slots == 8


async def batch_of_two_greedy(qpack: Path, ref: Any) -> tuple[list[list[int]], list[list[int]], set[int], int]:
    """Two prompts decoded together by the real engine (16 slots: every step misses; two
    layers of router predictions ahead; four O_DIRECT readers): (each prompt's tokens, the
    greedy tokens of `ref` (mlx-lm's resident model) for each prompt alone, the engine's
    stop ids, its largest decode batch)."""
    from helpers_engine import engine_config, generate

    from pipeline.engine import open_engine

    prompts = [PROMPT, [40, 1079, 264, 8, 3, 7000, 512, 2]]
    cfg = engine_config(qpack, pool={"slots": 16}, prefetch={"strategy": "lookahead", "depth": 2},
                        reader={"concurrency": 4, "o_direct": True})
    async with open_engine(cfg) as engine:
        eos = set(engine.tokenizer.eos_token_ids)
        want = [greedy_reference(ref, p, 8, eos, chunk=2) for p in prompts]
        got: list[list[int]] = [[], []]

        async def run(i: int) -> None:
            got[i] = list((await generate(engine, prompts[i], 8)).token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(run, i)
        return got, want, eos, engine.largest_batch


def assert_close_to_transformers(src: Path, qpack: Path, class_name: str, tol: float = 1e-4) -> None:
    """Every position's logits within `tol` of transformers' PyTorch model in fp32, which
    loaded every tensor of the checkpoint and missed none."""
    import numpy as np
    import pytest

    torch = pytest.importorskip("torch")
    import transformers

    ours = DirectForward(qpack)
    got = np.array(ours.forward(PROMPT, ours.make_cache())[0])
    ours.close()
    model, loading = getattr(transformers, class_name).from_pretrained(src, dtype=torch.float32,
                                                                       output_loading_info=True)
    # The checkpoint's tensor names and shapes are transformers' own, key by key.
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    model.eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
    assert got.shape == want.shape
    assert float(np.max(np.abs(got - want))) <= tol


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


async def served_tool_round_trip(container: Path, src: Path, forced: bool = True, greedy: bool = True) -> str:
    """The served engine's greedy tokens equal mlx-lm's for two prompts decoded in one batch
    (next-gate prefetch; `greedy` False leaves that out, ~3 s, where another test of the
    same forward pass has it); then, through the real server and the official openai client, a request with
    tools, the assistant's call and the tool's result fed back; a forced call through the
    openai and anthropic clients (`forced_calls`; off for Qwen's JSON markup, which
    tests/test_server_agent_apis.py forces). Returns the prompt the server
    built for the last request (the family's markup, for the caller to check)."""
    import json

    import openai
    from helpers_server import serving

    async with serving(container, prefill_chunk=4) as (engine, port):
        if greedy:
            await _greedy_batch_of_two(engine, src)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        plain = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
        result = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
        answered = await client.chat.completions.create(model="tiny", messages=result, tools=TOOLS, max_tokens=1)
        assert plain.usage and answered.usage and answered.usage.prompt_tokens > plain.usage.prompt_tokens
        tokens = engine.chat_tokens(
            [*USER, {"role": "assistant", "content": "", "tool_calls": [
                {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
             result[-1]], TOOLS)
        assert len(tokens) == answered.usage.prompt_tokens
        if forced:
            await forced_calls(client, port)
        return engine.tokenizer.decode(tokens)


async def _greedy_batch_of_two(engine: Any, src: Path) -> None:
    """Two requests at once decode in one batch (plain KV caches merged); each row gets
    mlx-lm's tokens for its prompt alone."""
    from helpers_engine import generate

    prompts = (PROMPT, PROMPT[5:])
    eos = set(engine.tokenizer.eos_token_ids)
    want = [greedy_reference(reference(src), p, 12, eos, chunk=4) for p in prompts]
    got: dict[int, list[int]] = {}

    async def run(i: int) -> None:
        got[i] = list((await generate(engine, prompts[i], 12)).token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(run, i)
    assert [got[i] for i in range(len(prompts))] == want
    assert engine.largest_batch == 2


# Bounded values, so a random model's forced call ends within a few tokens.
FORCED = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"]}


async def forced_calls(client: Any, port: int) -> None:
    """A forced call through the official openai and anthropic clients: the grammar writes
    the family's own markup (pipeline/server/call_grammar.py), the server parses it back
    into an OpenAI tool call and an Anthropic tool_use block."""
    import anthropic

    def check(args: Any) -> None:
        assert args["city"] in ("Paris", "Lyon") and 1 <= args["days"] <= 7 and set(args) == {"city", "days"}

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": FORCED}}]
    reply = await client.chat.completions.create(
        model="tiny", messages=USER, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=48, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check(json.loads(call.function.arguments))
    # Streamed, the same call arrives in deltas (the prompt now comes from the prefix cache).
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=48, temperature=0, stream=True)
    names, arguments, finish = [], "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        for d in (delta.tool_calls or []) if delta else []:
            names += [d.function.name] if d.function and d.function.name else []
            arguments += d.function.arguments or "" if d.function else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert names == ["get_weather"] and json.loads(arguments) == json.loads(call.function.arguments)
    assert finish == "tool_calls"
    claude = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0)
    used = await claude.messages.create(
        model="tiny", max_tokens=48, messages=USER, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": FORCED}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [block] = [b for b in used.content if b.type == "tool_use"]
    assert used.stop_reason == "tool_use" and block.name == "get_weather"
    check(block.input)


def parse_streamed(container: Path, text: str, in_reasoning: bool) -> tuple[str, str, list[tuple[str, dict]]]:
    """`text` as the model would stream it (encoded by the container's tokenizer, decoded
    token by token), through the server's output parser: (reasoning, content, calls)."""
    import json

    from actors.text_stream import TextStream
    from pipeline.engine_parts import cached_tokenizer
    from pipeline.server.tool_calls import Call, Content, OutputParser, Reasoning
    from qpack.reader import Container

    with Container.open(container, verify="off") as c:  # the tokenizer only: no sha256 of the core
        tok = cached_tokenizer(c.tokenizer_dir())
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer
    detok.reset()
    chain = TextStream(detok, ())
    parser = OutputParser(in_reasoning=in_reasoning, schemas=SCHEMAS)
    parts = []
    for token in ids:
        delta, _ = chain.add(token)
        parts += parser.feed(delta)
    parts += parser.feed(chain.finish()) + parser.finish()
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning)).strip()
    content = "".join(p.text for p in parts if isinstance(p, Content)).strip()
    calls = [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, Call)]
    return reasoning, content, calls
