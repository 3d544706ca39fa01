"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP.

One engine per test (opening one costs seconds), many checks per test. The model has
random weights, so the checks are about the protocol: shapes, streaming vs one-shot
agreement, seeds, stops, usage and prefix reuse, tool-call round trips.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from helpers_server import serving

from pipeline.engine import Engine


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


@asynccontextmanager
async def running_server(container: Path, server: dict[str, Any] | None = None,
                         **serve_kw: Any) -> AsyncIterator[tuple[Engine, str]]:
    async with serving(container, server, **serve_kw) as (engine, port):
        yield engine, f"http://127.0.0.1:{port}"


USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


async def test_chat_completions_models_and_metrics(container: Path) -> None:
    async with running_server(container) as (engine, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        assert (await client.models.retrieve("tiny")).id == "tiny"
        # The container path is accepted as the model name too.
        by_path = await client.chat.completions.create(
            model=str(container), messages=USER, max_tokens=2, seed=1)
        assert by_path.model == str(container)

        # Non-streaming vs streaming, same seed at temperature 1: the same text.
        kw: dict[str, Any] = {"model": "tiny", "messages": USER, "max_tokens": 12, "seed": 7,
                              "temperature": 1.0}
        one = await client.chat.completions.create(**kw)
        choice = one.choices[0]
        assert one.object == "chat.completion" and choice.message.role == "assistant"
        assert choice.finish_reason in ("length", "stop") and choice.message.content
        assert one.usage is not None
        assert one.usage.total_tokens == one.usage.prompt_tokens + one.usage.completion_tokens
        assert one.usage.completion_tokens <= 12
        again = await client.chat.completions.create(**kw)
        assert again.choices[0].message.content == choice.message.content

        chunks = [c async for c in await client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True})]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(deltas) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage == one.usage

        # Stop strings: cut before the first occurrence, never emitted, finish "stop".
        text = choice.message.content
        stop = text[len(text) // 2:][:2]
        cut = await client.chat.completions.create(**kw, stop=[stop, "\x00never"])
        assert cut.choices[0].message.content == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"

        # Plain completions, streamed and not.
        ckw: dict[str, Any] = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
                               "seed": 3}
        comp = await client.completions.create(**ckw)
        assert comp.object == "text_completion" and comp.usage is not None
        assert comp.usage.prompt_tokens == len(engine.encode("Once upon a time"))
        streamed = [c async for c in await client.completions.create(**ckw, stream=True)]
        assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text
        assert streamed[-1].choices[0].finish_reason == comp.choices[0].finish_reason

        # A follow-up turn reuses the state of turn 1's prompt (max_tokens=1 keeps exactly
        # that prompt in the prefix cache; longer replies need not re-tokenize identically).
        first = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=1,
                                                     seed=5)
        assert first.usage is not None
        follow = [*USER, {"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "And in Oslo?"}]
        second = await client.chat.completions.create(model="tiny", messages=follow, max_tokens=2)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens

        # Health and metrics see what happened.
        async with httpx2.AsyncClient(base_url=base) as http:
            assert (await http.get("/health")).json()["status"] == "ok"
            metrics = (await http.get("/metrics")).text
        values = dict(line.rsplit(" ", 1) for line in metrics.splitlines()
                      if not line.startswith("#"))
        assert int(values["moestream_tokens_generated_total"]) > 0
        assert float(values["moestream_decode_tokens_per_second"]) > 0
        assert int(values["moestream_pool_bytes"]) == engine.pool_bytes
        assert int(values['moestream_requests_total{path="/v1/chat/completions",status="200"}']) == 7
        assert "moestream_queue_depth 0" in metrics and "moestream_pool_hit_rate" in metrics
        rss = int(values["moestream_resident_memory_bytes"])
        assert 50 * 2**20 < rss < 64 * 2**30
        assert 0 < int(values["moestream_decode_resident_memory_bytes"]) < 2 * rss
        assert int(values["moestream_decode_device_memory_bytes"]) >= engine.pool_bytes
        assert int(values["moestream_heap_trimmed_bytes_total"]) >= 0
        # The prompts kept for reuse (the follow-up above found one), as the cache counts them.
        entries, held = engine.prefix_cache.usage()
        assert int(values["moestream_prefix_cache_entries"]) == entries > 0
        assert int(values["moestream_prefix_cache_bytes"]) == held > 0
        assert int(values["moestream_prefetch_shelved_total"]) >= 0
        assert int(values["moestream_drafts_accepted_total"]) == 0  # speculation is off
        assert int(values["moestream_shadow_drafts_total"]) == 0  # ... so `auto` asked nothing

        # Speculative decoding per request: the same text; a bad mode is one clear 400.
        fast = await client.chat.completions.create(**kw, extra_body={"speculative": "ngram"})
        assert fast.choices[0].message.content == choice.message.content
        with pytest.raises(openai.BadRequestError, match="speculative"):
            await client.chat.completions.create(**kw, extra_body={"speculative": "always"})
        with pytest.raises(openai.BadRequestError, match="MTP head"):
            await client.chat.completions.create(**kw, extra_body={"speculative": "mtp"})


async def test_tool_round_trip(container: Path) -> None:
    async with running_server(container) as (engine, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        plain = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
        with_tools = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=1)
        named = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, max_tokens=1,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        none = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=1)
        assert plain.usage and with_tools.usage and named.usage and none.usage
        # The tool signatures are in the prompt, except with tool_choice "none".
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
        assert named.usage.prompt_tokens == with_tools.usage.prompt_tokens
        assert none.usage.prompt_tokens == plain.usage.prompt_tokens

        # Feed back an assistant tool call and the tool's result, as a client does.
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
        turn = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
        result = [*turn, {"role": "tool", "tool_call_id": "call_1",
                          "content": "18 degrees and sunny"}]
        asked = await client.chat.completions.create(model="tiny", messages=turn, tools=TOOLS,
                                                     max_tokens=1)
        answered = await client.chat.completions.create(model="tiny", messages=result,
                                                        tools=TOOLS, max_tokens=1)
        assert asked.usage and answered.usage
        assert answered.usage.prompt_tokens > asked.usage.prompt_tokens
        # The prompt the server built holds the call (arguments as JSON) and the result.
        tokens = engine.chat_tokens(
            [*turn[:-1], {"role": "assistant", "content": "",
                          "tool_calls": [{**call, "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris"}}}]},
             result[-1]], TOOLS)
        assert len(tokens) == answered.usage.prompt_tokens
        prompt = engine.tokenizer.decode(tokens)
        assert '"arguments": {"city": "Paris"}' in prompt
        assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt

        # Content as text parts is the same prompt as the plain string.
        parts = await client.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is the weather "},
                                         {"type": "text", "text": "in Paris?"}]}])
        assert parts.usage and parts.usage.prompt_tokens == plain.usage.prompt_tokens
