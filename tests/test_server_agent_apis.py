"""The APIs coding agents speak: OpenAI's Responses API and Anthropic's Messages API, driven
by the official `openai` and `anthropic` clients (streaming and not, tools, structured
output), and the thinking switch on a thinking template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
from helpers_conformance import TOOLS, USER, WEATHER, check_weather, client, running

# `anthropic` is imported in the tests that drive it: at module level it cost every xdist
# worker ~1.8 s of CPU at collection, the one without these tests too.


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


async def test_responses_and_anthropic_messages(container: Path) -> None:
    import anthropic

    async with running(container) as (engine, base):
        v1 = client(f"{base}/v1")
        resp = await v1.responses.create(model="tiny", input="Tell me about Paris.",
                                         instructions="Be brief.", max_output_tokens=4,
                                         temperature=0)
        assert resp.status == "incomplete" and resp.usage.output_tokens == 4
        assert resp.output_text and resp.output[0].type == "message"
        events = [e async for e in await v1.responses.create(
            model="tiny", input="Tell me about Paris.", instructions="Be brief.",
            max_output_tokens=4, temperature=0, stream=True)]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        # A message is announced empty and in progress; its one part comes with its own event.
        [added] = [e.item for e in events if e.type == "response.output_item.added"]
        assert added.type == "message" and added.content == [] and added.status == "in_progress"
        assert sum(e.type == "response.content_part.added" for e in events) == 1
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
            resp.output_text
        assert events[-1].response.output_text == resp.output_text
        fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
        structured = await v1.responses.create(model="tiny", input="Weather?", text=fmt,
                                               max_output_tokens=60, temperature=0)
        check_weather(json.loads(structured.output_text))
        rtools = [{"type": "function", "name": t["function"]["name"],
                   "parameters": t["function"]["parameters"]} for t in TOOLS]
        call = await v1.responses.create(
            model="tiny", input=[{"role": "user", "content": "Time?"}], tools=rtools,
            tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
            max_output_tokens=60)
        fc = [o for o in call.output if o.type == "function_call"]
        assert fc and fc[0].name == "get_time" and json.loads(fc[0].arguments)["tz"] in ("UTC", "CET")
        # The call and its output fed back as input items.
        follow = await v1.responses.create(model="tiny", max_output_tokens=2, tools=rtools, input=[
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": fc[0].call_id, "name": "get_time",
             "arguments": fc[0].arguments},
            {"type": "function_call_output", "call_id": fc[0].call_id, "output": "12:00"}])
        assert follow.usage.input_tokens > call.usage.input_tokens
        # Text and a call of one assistant turn (as agents send them back) render as one
        # turn, and a tool's output may come as content parts.
        from pipeline.server.routes_responses import ResponsesRequest, to_chat

        turn = [{"role": "user", "content": "Time?"},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Let me check."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1",
                 "output": [{"type": "input_text", "text": "12:00"}]}]
        chat = to_chat(msgspec.convert({"input": turn}, ResponsesRequest))["messages"]
        assert [m["role"] for m in chat] == ["user", "assistant", "tool"]
        assert chat[1]["tool_calls"][0]["id"] == "c1" and chat[2]["content"][0]["text"] == "12:00"
        parts = await v1.responses.create(model="tiny", max_output_tokens=2, tools=rtools, input=turn)
        assert parts.status in ("completed", "incomplete")

        claude = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        msg = await claude.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0},
                                           system="Be brief.", messages=USER)
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
        assert msg.content[0].type == "text" and msg.content[0].text
        async with claude.messages.stream(model="tiny", max_tokens=4, extra_body={"temperature": 0},
                                          system="Be brief.", messages=USER) as stream:
            streamed = await stream.get_final_message()
        assert streamed.content[0].text == msg.content[0].text
        # A stop sequence ends the reply before it and is named.
        text = msg.content[0].text
        stop = text[1:3]
        cut = await claude.messages.create(model="tiny", max_tokens=4, system="Be brief.",
                                           messages=USER, stop_sequences=[stop, "\x00never"],
                                           extra_body={"temperature": 0})
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert stop not in "".join(b.text for b in cut.content if b.type == "text")
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                 for t in TOOLS]
        used = await claude.messages.create(model="tiny", max_tokens=120, messages=USER,
                                            tools=tools,
                                            tool_choice={"type": "any", "disable_parallel_tool_use": True})
        blocks = [b for b in used.content if b.type == "tool_use"]
        assert used.stop_reason == "tool_use" and blocks
        async with claude.messages.stream(
                model="tiny", max_tokens=120, messages=USER, tools=tools,
                tool_choice={"type": "tool", "name": "get_weather",
                             "disable_parallel_tool_use": True}) as stream:
            final = await stream.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather"
        check_weather(uses[0].input)
        # A tool result goes back in a user turn.
        again = await claude.messages.create(model="tiny", max_tokens=2, tools=tools, messages=[
            *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id,
                                                      "name": "get_weather",
                                                      "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "sunny"}]}])
        # input_tokens leaves out what came from the prefix cache (Anthropic's accounting).
        assert again.usage.input_tokens + again.usage.cache_read_input_tokens > \
            used.usage.input_tokens + used.usage.cache_read_input_tokens
        counted = await claude.messages.count_tokens(model="tiny", system="Be brief.",
                                                     messages=USER)
        assert counted.input_tokens == (msg.usage.input_tokens
                                        + msg.usage.cache_read_input_tokens)
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.messages.create(model="tiny", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
        assert bad.value.body["type"] == "error"


@pytest.fixture(scope="module")
def thinking_container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_5_moe"), bits=None)


async def test_thinking_switch_and_constraints_on_a_thinking_template(
        thinking_container: Path) -> None:
    import anthropic

    async with running(thinking_container) as (engine, base):
        v1 = client(f"{base}/v1")
        kw: dict[str, Any] = {"model": "tiny", "messages": USER, "max_tokens": 4, "seed": 3}
        thinking = await v1.chat.completions.create(**kw)
        # The template opens <think>: a short reply is all reasoning, no content.
        assert thinking.choices[0].message.reasoning_content and not thinking.choices[
            0].message.content
        plain = await v1.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert plain.choices[0].message.content
        assert getattr(plain.choices[0].message, "reasoning_content", None) is None
        # The switch changes the prompt: an empty think block is written into it.
        assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
        async with httpx2.AsyncClient(base_url=base, timeout=60) as http:
            tok = (await http.post("/tokenize", json={
                "messages": USER, "chat_template_kwargs": {"enable_thinking": False}})).json()
        assert tok["count"] == plain.usage.prompt_tokens
        # Anthropic's thinking switch maps onto the same template variable.
        claude = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        off = await claude.messages.create(model="tiny", max_tokens=2, messages=USER,
                                           thinking={"type": "disabled"})
        assert off.usage.input_tokens + off.usage.cache_read_input_tokens == \
            plain.usage.prompt_tokens
        # Thinking is opt-in on Anthropic's API: without `thinking`, text comes first.
        silent = await claude.messages.create(model="tiny", max_tokens=2, messages=USER)
        assert silent.content[0].type == "text"
        assert silent.usage.input_tokens + silent.usage.cache_read_input_tokens == \
            plain.usage.prompt_tokens
        on = await claude.messages.create(model="tiny", max_tokens=2, messages=USER,
                                          thinking={"type": "enabled", "budget_tokens": 1024})
        assert on.content[0].type == "thinking" and on.content[0].thinking
        # Constrained output is the reply's content, not reasoning, even with thinking on.
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        for extra in ({}, {"chat_template_kwargs": {"enable_thinking": True}}):
            one = await v1.chat.completions.create(model="tiny", messages=USER,
                                                   max_tokens=60, seed=1,
                                                   response_format=fmt, extra_body=extra)
            check_weather(json.loads(one.choices[0].message.content))


@pytest.fixture(scope="module")
def always_thinking(synth_checkpoint, packed) -> Path:
    # The Thinking variant test_generation_config.py packs too: one synth and pack a session.
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16", variant="thinking"), bits=4)


async def test_anthropic_thinking_is_opt_in_on_an_always_thinking_template(
        always_thinking: Path) -> None:
    """Qwen3-Next Thinking's template opens <think> whatever enable_thinking says: without
    `thinking`, the reasoning is not sent as a thinking block."""
    import anthropic

    async with running(always_thinking) as (engine, base):
        claude = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        kw: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "messages": USER,
                              "extra_body": {"temperature": 0}}
        shown = await claude.messages.create(**kw, thinking={"type": "enabled",
                                                             "budget_tokens": 1024})
        assert shown.content and shown.content[0].type == "thinking"
        silent = await claude.messages.create(**kw)
        assert all(b.type == "text" for b in silent.content)
        async with claude.messages.stream(**kw) as stream:
            streamed = await stream.get_final_message()
        assert all(b.type == "text" for b in streamed.content)
