"""Ollama's API driven by the official `ollama` client: chat and generate, streamed
(NDJSON) and not, `options`, `format` (json and a schema), tools in the prompt, tool
results, raw prompts and `context`, the model list, show, the running model, version and
the root's ping, model management refused in one line, and errors in Ollama's shape."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import ollama
import pytest
from helpers_conformance import TOOLS, USER, WEATHER, check_weather, running

from pipeline.server import routes_ollama
from pipeline.server.tool_calls import Call


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


async def test_ollama_client(container: Path) -> None:
    async with running(container) as (engine, base):
        client = ollama.AsyncClient(host=base)
        assert (await client.list()).models[0].model == "tiny"
        shown = await client.show("tiny")
        assert shown.details.family == "qwen3_next" and "completion" in shown.capabilities
        assert "tools" in shown.capabilities and shown.template
        async with httpx2.AsyncClient(base_url=base, timeout=60) as http:
            assert (await http.get("/api/version")).json()["version"]
            # Ollama's CLI pings the root before anything else.
            assert (await http.head("/")).status_code == 200
            assert (await http.get("/")).text == "moestream is running"
        running_models = (await client.ps()).models
        assert [m.model for m in running_models] == ["tiny"]
        facts = engine.facts
        assert running_models[0].size == facts.dense_bytes + facts.pool_bytes
        assert running_models[0].size_vram == 0  # MLX's CPU backend: nothing on a GPU
        assert running_models[0].expires_at.year > 2300  # loaded for good: "Forever"
        with pytest.raises(ollama.ResponseError) as refused:
            await client.pull("qwen3:30b")
        assert refused.value.status_code == 400 and "moestream pack" in refused.value.error
        with pytest.raises(ollama.ResponseError) as refused:
            await client.delete("tiny")
        assert refused.value.status_code == 400 and "/api/delete" in refused.value.error

        opts = {"temperature": 0, "num_predict": 4}
        one = await client.chat(model="tiny", messages=USER, options=opts)
        assert one.done and one.done_reason == "length" and one.eval_count == 4
        assert one.message.role == "assistant" and one.message.content
        assert one.prompt_eval_count == len(engine.chat_tokens(USER))  # nothing cached yet
        parts = [p async for p in await client.chat(model="tiny", messages=USER, options=opts,
                                                   stream=True)]
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        assert "".join(p.message.content for p in parts) == one.message.content
        assert parts[-1].eval_count == 4 and parts[-1].done_reason == "length"

        # format: "json" and a JSON schema constrain the reply.
        as_json = await client.chat(model="tiny", messages=USER, format="json",
                                    options={"num_predict": 16, "seed": 1})
        if as_json.done_reason == "stop":
            assert isinstance(json.loads(as_json.message.content), dict)
        schema = await client.chat(model="tiny", messages=USER, format=WEATHER,
                                   options={"num_predict": 60, "seed": 1})
        check_weather(json.loads(schema.message.content))

        # Tools reach the template; a tool call and its result go back as messages.
        with_tools = await client.chat(model="tiny", messages=USER, tools=TOOLS, options=opts)
        assert with_tools.prompt_eval_count > one.prompt_eval_count
        follow = await client.chat(model="tiny", tools=TOOLS, options=opts, messages=[
            *USER, {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
            {"role": "tool", "content": "12:00", "tool_name": "get_time"}])
        assert follow.prompt_eval_count > 0 and follow.done
        async with httpx2.AsyncClient(base_url=base, timeout=60) as http:  # content: null, as
            replayed = await http.post("/api/chat", json={  # OpenAI-style clients replay a call
                "model": "tiny", "stream": False, "options": opts, "messages": [
                    *USER, {"role": "assistant", "content": None, "tool_calls": [
                        {"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
                    {"role": "tool", "content": "12:00", "tool_name": "get_time"}]})
            assert replayed.status_code == 200 and replayed.json()["done"], replayed.text

        # generate: the prompt as a user turn, or raw; `context` carries the tokens on.
        gen = await client.generate(model="tiny", prompt="Tell me about Paris.", options=opts)
        assert gen.response == one.message.content and gen.eval_count == 4
        assert len(gen.context) == len(engine.chat_tokens(USER)) + 4
        raw = await client.generate(model="tiny", prompt="The capital of France is", raw=True,
                                    options=opts)
        assert raw.response and raw.context[:len(engine.encode("The capital of France is"))] \
            == engine.encode("The capital of France is")
        streamed = [p async for p in await client.generate(
            model="tiny", prompt="The capital of France is", raw=True, options=opts,
            stream=True)]
        assert "".join(p.response for p in streamed) == raw.response
        more = await client.generate(model="tiny", prompt=" and", raw=True, options=opts,
                                     context=raw.context)
        assert more.context[:len(raw.context)] == raw.context
        # A stop string inside the last token: the context holds what the caller got.
        stop = raw.response[len(raw.response) // 2]
        cut = await client.generate(model="tiny", prompt="The capital of France is", raw=True,
                                    options={**opts, "stop": [stop]})
        assert cut.done_reason == "stop" and stop not in cut.response
        assert engine.tokenizer.decode(cut.context) == "The capital of France is" + cut.response
        # num_predict is an upper bound (the server's limit past it), 0 none of its own.
        long = await client.generate(model="tiny", prompt="Hi", raw=True,
                                     options={"num_predict": 10**6, "temperature": 0})
        assert long.done and long.eval_count <= 8192

        # Nothing to generate: what clients send to load a model.
        loaded = await client.chat(model="tiny", messages=[])
        assert loaded.done and loaded.done_reason == "load" and not loaded.message.content
        assert (await client.generate(model="tiny", prompt="")).done_reason == "load"

        # Errors are one line in Ollama's shape, with the status.
        with pytest.raises(ollama.ResponseError) as bad:
            await client.chat(model="tiny", messages=[{"role": "user", "content": "x",
                                                       "images": ["AAAA"]}])
        assert bad.value.status_code == 400 and "images" in bad.value.error
        with pytest.raises(ollama.ResponseError) as bad:
            await client.chat(model="tiny", messages=USER, options={"temperature": "hot"})
        assert bad.value.status_code == 400 and "temperature" in bad.value.error
        async with httpx2.AsyncClient(base_url=base, timeout=60) as http:
            res = await http.post("/api/chat", content=b"{")
            assert res.status_code == 400 and set(res.json()) == {"error"}


def test_tool_calls_in_ollamas_shape() -> None:
    """Arguments are an object, not OpenAI's JSON text."""
    out = routes_ollama.ollama_message("", "", [Call(0, "call_1", "get_time", '{"tz": "UTC"}')])
    assert out == {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}
