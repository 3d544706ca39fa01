"""What agents and chat apps expect of the server, driven by the official clients over HTTP.

The peer-suite idea (llama.cpp's and mlx-lm's server tests) kept in-house: each feature
through the `openai` (and `anthropic`) client, streaming and not. The model has random
weights, which makes constrained decoding a strong test: nothing but the grammar keeps
its output valid.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import trio
from helpers_server import pack_tiny, serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.engine import Engine


@pytest.fixture(scope="module")
def container(synth_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_tiny(synth_checkpoint, tmp_path_factory, "conformance")


@asynccontextmanager
async def running(container: Path, **serve_kw: Any) -> AsyncIterator[tuple[Engine, str]]:
    async with serving(container, {"context_limit": 512}, prefill_chunk=64,
                       **serve_kw) as (engine, port):
        yield engine, f"http://127.0.0.1:{port}"


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "Tell me about Paris."}]


async def test_lenient_requests_names_routes_and_cors(container: Path) -> None:
    async with running(container, aliases=("moe-chat",), cors_origins=("http://ui.local",)) as (
            engine, base):
        bare = client(base)  # no /v1: the routes answer there too
        assert [m.id for m in (await bare.models.list()).data] == ["tiny", "moe-chat"]
        # Vendor fields are ignored; chat_template_kwargs reach the template (unused ones
        # are harmless); an alias and a foreign name are served (not strict).
        kw: dict[str, Any] = {"messages": USER, "max_tokens": 3, "seed": 1}
        one = await bare.chat.completions.create(model="moe-chat", **kw, extra_body={
            "cache_prompt": True, "n_predict": 9, "repetition_context_size": 20,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert one.model == "moe-chat" and one.usage.completion_tokens <= 3
        other = await bare.chat.completions.create(model="gpt-4o", **kw)
        assert other.choices[0].message.content == one.choices[0].message.content
        async with httpx2.AsyncClient(base_url=base, timeout=60) as http:
            resp = await http.post("/v1/chat/completions", json=kw)  # no model at all
            assert resp.status_code == 200 and resp.json()["model"] == "tiny"

            # Tokenize (vLLM and llama.cpp forms) and back.
            tok = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
            assert tok["count"] == len(tok["tokens"]) == len(engine.encode("Hello world"))
            assert (await http.post("/v1/tokenize", json={"content": "Hello world"})).json()[
                "tokens"] == tok["tokens"]
            back = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            assert back["prompt"] == back["content"] == "Hello world"
            chat_tok = (await http.post("/tokenize", json={"messages": USER})).json()
            assert chat_tok["count"] == one.usage.prompt_tokens

            # CORS for the listed origin only; preflight needs no key.
            pre = await http.options("/v1/chat/completions", headers={
                "Origin": "http://ui.local", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert pre.status_code == 200
            assert pre.headers["access-control-allow-origin"] == "http://ui.local"
            got = await http.get("/v1/models", headers={"Origin": "http://evil.local"})
            assert "access-control-allow-origin" not in got.headers

        # Assistant prefill: the last assistant message is continued, not closed.
        v1 = client(f"{base}/v1")
        prefix = "Paris is the capital"
        cont = await v1.chat.completions.create(
            model="tiny", messages=[*USER, {"role": "assistant", "content": prefix}],
            max_tokens=2, seed=1)
        opened = engine.tokenizer.apply_chat_template(USER, tokenize=False,
                                                      add_generation_prompt=True)
        assert cont.usage.prompt_tokens == len(engine.encode(opened + prefix))

        # n > 1: seeded choices, usage counts the prompt once.
        many = await v1.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                                n=2, seed=5)
        assert [c.index for c in many.choices] == [0, 1]
        assert many.usage.prompt_tokens == one.usage.prompt_tokens
        streamed = [c async for c in await v1.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, n=2, seed=5, stream=True)]
        for i in (0, 1):
            text = "".join(c.choices[0].delta.content or "" for c in streamed
                           if c.choices and c.choices[0].index == i)
            assert text == many.choices[i].message.content
        # A list of prompts on /completions, n each.
        texts = await v1.completions.create(model="tiny", prompt=["Hello", "Good night"],
                                            max_tokens=2, n=2, seed=3)
        assert [c.index for c in texts.choices] == [0, 1, 2, 3]
        assert texts.usage.prompt_tokens == len(engine.encode("Hello")) + len(
            engine.encode("Good night"))


async def test_logprobs_echo_and_logit_bias(container: Path) -> None:
    async with running(container) as (engine, base):
        v1 = client(f"{base}/v1")
        kw: dict[str, Any] = {"model": "tiny", "messages": USER, "max_tokens": 6,
                              "temperature": 0, "logprobs": True, "top_logprobs": 3}
        one = await v1.chat.completions.create(**kw)
        content = one.choices[0].logprobs.content
        assert len(content) == one.usage.completion_tokens == 6
        for entry in content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
            # Greedy: the chosen token is the most likely one.
            assert entry.token == entry.top_logprobs[0].token
            assert entry.logprob == pytest.approx(tops[0], abs=1e-5)
        assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == \
            one.choices[0].message.content
        chunks = [c async for c in await v1.chat.completions.create(**kw, stream=True)]
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in content]
        plain = {k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")}
        assert (await v1.chat.completions.create(**plain)).choices[0].logprobs is None

        # Legacy completions: logprobs=k, echo puts the prompt (without logprobs) first.
        prompt = "The weather in Paris"
        text = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                           temperature=0, logprobs=2, echo=True)
        choice = text.choices[0]
        n_prompt = len(engine.encode(prompt))
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[:n_prompt] == [None] * n_prompt
        assert all(v <= 0 for v in lp.token_logprobs[n_prompt:])
        assert all(len(top) <= 2 for top in lp.top_logprobs[n_prompt:])
        assert lp.text_offset[n_prompt] == len(prompt)

        # logit_bias: +100 on one token makes greedy pick it every time; -100 bans it.
        token = engine.encode(" Lyon")[0]
        forced = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                             temperature=0, logit_bias={str(token): 100},
                                             logprobs=0)
        assert forced.choices[0].logprobs.tokens == [" Lyon"] * 4
        free = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                           temperature=0, logprobs=0)
        first = engine.encode(free.choices[0].text)[0]
        banned = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                             temperature=0, logit_bias={str(first): -100})
        assert banned.choices[0].text != free.choices[0].text


WEATHER = {"type": "object", "properties": {
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "city": {"type": "string", "maxLength": 6},
    "alerts": {"type": "boolean"}},
    "required": ["unit", "days", "city", "alerts"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]


def check_weather(obj: Any) -> None:
    assert isinstance(obj, dict) and set(obj) == {"unit", "days", "city", "alerts"}, obj
    assert obj["unit"] in ("celsius", "fahrenheit") and type(obj["days"]) is int
    assert 1 <= obj["days"] <= 7 and isinstance(obj["alerts"], bool)
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 6


async def test_constrained_decoding_json_and_tool_calls(container: Path) -> None:
    async with running(container) as (engine, base):
        v1 = client(f"{base}/v1")
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
        for seed in range(3):
            one = await v1.chat.completions.create(model="tiny", messages=USER, max_tokens=60,
                                                   seed=seed, response_format=fmt)
            assert one.choices[0].finish_reason == "stop"
            check_weather(json.loads(one.choices[0].message.content))
        chunks = [c async for c in await v1.chat.completions.create(
            model="tiny", messages=USER, max_tokens=60, seed=9, response_format=fmt,
            stream=True)]
        check_weather(json.loads("".join(c.choices[0].delta.content or "" for c in chunks
                                         if c.choices)))
        text = await v1.completions.create(model="tiny", prompt="Weather:", max_tokens=60,
                                           seed=2, extra_body={"response_format": fmt})
        check_weather(json.loads(text.choices[0].text))

        # json_object: any object. Favouring `"`, then `}`, makes a random model close
        # its strings and then the object within the budget (the mask decides where each
        # is allowed).
        quote, close = engine.encode('"')[0], engine.encode("}")[0]
        obj = await v1.chat.completions.create(
            model="tiny", messages=USER, max_tokens=40, temperature=0,
            response_format={"type": "json_object"},
            logit_bias={str(quote): 100, str(close): 50})
        assert obj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(obj.choices[0].message.content), dict)

        # tool_choice required: at least one call, to a listed tool, arguments per its schema.
        for seed in range(2):
            req = await v1.chat.completions.create(model="tiny", messages=USER, max_tokens=120,
                                                   seed=seed, tools=TOOLS,
                                                   tool_choice="required",
                                                   parallel_tool_calls=False)
            choice = req.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0].function
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                check_weather(args)
            else:
                assert call.name == "get_time" and args in ({"tz": "UTC"}, {"tz": "CET"})
        named = {"type": "function", "function": {"name": "get_weather"}}
        chunks = [c async for c in await v1.chat.completions.create(
            model="tiny", messages=USER, max_tokens=120, seed=4, tools=TOOLS,
            tool_choice=named, stream=True)]
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert calls and all(tc.function.name == "get_weather" for tc in calls)
        for tc in calls:
            check_weather(json.loads(tc.function.arguments))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

        # A schema the grammar engine cannot compile is the client's error.
        with pytest.raises(openai.BadRequestError) as bad:
            await v1.chat.completions.create(model="tiny", messages=USER, max_tokens=5,
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "x",
                                                                              "schema": {"type": "bogus"}}})
        assert bad.value.body["param"] == "response_format"


async def test_responses_and_anthropic_messages(container: Path) -> None:
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
            tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=60)
        fc = [o for o in call.output if o.type == "function_call"]
        assert fc and fc[0].name == "get_time" and json.loads(fc[0].arguments)["tz"] in ("UTC", "CET")
        # The call and its output fed back as input items.
        follow = await v1.responses.create(model="tiny", max_output_tokens=2, tools=rtools, input=[
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": fc[0].call_id, "name": "get_time",
             "arguments": fc[0].arguments},
            {"type": "function_call_output", "call_id": fc[0].call_id, "output": "12:00"}])
        assert follow.usage.input_tokens > call.usage.input_tokens

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
                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
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


# -- hypothesis: the new surface never answers 5xx -----------------------------------------

_SCHEMA_LEAF = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                             "array", "bogus"]) | st.integers(),
    "enum": st.lists(st.integers(0, 3) | st.text(max_size=3), max_size=3),
    "maxLength": st.integers(-1, 4), "minimum": st.integers(-5, 5),
    "maximum": st.integers(-5, 5), "pattern": st.sampled_from(["^a+$", "[", "\\d{2}"]),
    "$ref": st.sampled_from(["#/nope", "#", "#/properties/a"])})
_SCHEMAS = st.recursive(_SCHEMA_LEAF, lambda inner: st.fixed_dictionaries(
    {"type": st.just("object")}, optional={
        "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
        "required": st.lists(st.text(max_size=4), max_size=2),
        "additionalProperties": st.booleans() | inner,
        "anyOf": st.lists(inner, max_size=2)}), max_leaves=6)
_MSG = [{"role": "user", "content": "hi"}]
_TOOL = st.builds(lambda name, params: {"type": "function", "function": {
    "name": name, "parameters": params}}, st.sampled_from(["f", "g", ""]), _SCHEMAS)


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["/v1/chat/completions", "/chat/completions", "/completions",
                                  "/v1/responses", "/v1/messages", "/tokenize",
                                  "/detokenize"]))
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, 2))}
    if route.endswith("chat/completions"):
        body["messages"] = draw(st.sampled_from([_MSG, [*_MSG, {"role": "assistant",
                                                              "content": draw(st.text(max_size=5))}]]))
        body.update(draw(st.fixed_dictionaries({}, optional={
            "response_format": st.one_of(
                st.just({"type": "json_object"}),
                _SCHEMAS.map(lambda sc: {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": sc}}),
                st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)),
            "tools": st.lists(_TOOL, max_size=2),
            "tool_choice": st.sampled_from(["required", "none", "auto", "bogus",
                                            {"type": "function", "function": {"name": "f"}}]),
            "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25),
            "n": st.integers(0, 3), "logit_bias": st.dictionaries(
                st.sampled_from(["1", "-1", "x", "999999999"]), st.floats(-150, 150), max_size=2),
            "chat_template_kwargs": st.dictionaries(
                st.sampled_from(["enable_thinking", "tools", "x"]), st.booleans(), max_size=2),
            "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans(),
            "cache_prompt": st.booleans(), "model": st.sampled_from(["tiny", "gpt-4o", ""])})))
    elif route == "/completions":
        body["prompt"] = draw(st.one_of(st.text(max_size=8), st.lists(st.integers(-1, 200),
                                                                      max_size=3),
                                        st.lists(st.text(min_size=1, max_size=4), max_size=3),
                                        st.lists(st.lists(st.integers(0, 200), max_size=3),
                                                 max_size=2)))
        body.update(draw(st.fixed_dictionaries({}, optional={
            "logprobs": st.integers(-1, 25), "echo": st.booleans(), "n": st.integers(0, 3),
            "best_of": st.integers(0, 3), "suffix": st.text(max_size=2)})))
    elif route == "/v1/responses":
        body = {"max_output_tokens": body["max_tokens"], "input": draw(st.one_of(
            st.text(max_size=8), st.lists(st.fixed_dictionaries({}, optional={
                "type": st.sampled_from(["message", "function_call", "function_call_output",
                                         "reasoning", "web_search"]),
                "role": st.sampled_from(["user", "assistant", "tool", "x"]),
                "content": st.text(max_size=5), "call_id": st.text(max_size=3),
                "output": st.text(max_size=3)}), max_size=3)))}
        body.update(draw(st.fixed_dictionaries({}, optional={
            "text": _SCHEMAS.map(lambda sc: {"format": {"type": "json_schema", "name": "x",
                                                        "schema": sc}}),
            "tool_choice": st.sampled_from(["required", {"type": "function", "name": "f"}]),
            "tools": st.lists(st.builds(lambda t: {"type": "function", "name": "f",
                                                   "parameters": t}, _SCHEMAS), max_size=1),
            "previous_response_id": st.just("resp_1")})))
    elif route == "/v1/messages":
        block = st.fixed_dictionaries({"type": st.sampled_from(
            ["text", "tool_use", "tool_result", "image", "thinking"])}, optional={
            "text": st.text(max_size=4), "id": st.text(max_size=3), "name": st.text(max_size=3),
            "input": st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
            "tool_use_id": st.text(max_size=3), "content": st.text(max_size=3)})
        body["messages"] = draw(st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.text(max_size=5) | st.lists(block, max_size=2)}), max_size=3))
        body.update(draw(st.fixed_dictionaries({}, optional={
            "system": st.text(max_size=5), "stream": st.booleans(),
            "tool_choice": st.sampled_from([{"type": "any"}, {"type": "tool", "name": "f"},
                                            {"type": "none"}, {"type": "x"}]),
            "tools": st.lists(st.builds(lambda sc: {"name": "f", "input_schema": sc},
                                        _SCHEMAS), max_size=1)})))
    elif route == "/tokenize":
        body = draw(st.fixed_dictionaries({}, optional={
            "prompt": st.text(max_size=5), "content": st.text(max_size=5) | st.integers(),
            "messages": st.just(_MSG)}))
    else:
        body = {"tokens": draw(st.lists(st.integers(-2, 200_000), max_size=4))}
    if route != "/v1/messages" and draw(st.booleans()):
        body["stream"] = True
    return route, body


@given(case=_bodies())
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def _fuzz(base: str, tally: dict[str, int], case: tuple[str, dict[str, Any]]) -> None:
    route, body = case
    with httpx2.Client(base_url=base, timeout=60) as http:
        resp = http.post(route, json=body)
    assert resp.status_code < 500, (route, body, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["message"] and "Traceback" not in err["message"], err
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in resp.text.replace('"error":null', ""), resp.text[-300:]
    key = f"{route} {resp.status_code}"
    tally[key] = tally.get(key, 0) + 1


async def test_fuzzed_new_surface_never_5xx(container: Path) -> None:
    async with running(container) as (engine, base):
        tally: dict[str, int] = {}
        await trio.to_thread.run_sync(lambda: _fuzz(base, tally))
        print("outcomes:", tally)
        assert sum(v for k, v in tally.items() if k.endswith(" 200")) >= 10, tally
        assert engine.waiting == 0 and not engine.lock.locked()


def test_serve_flags_become_server_config() -> None:
    from pipeline.cli import build_parser
    from pipeline.cli.serve import server_overrides
    from pipeline.config.schema import config_from_dict

    args = build_parser().parse_args([
        "serve", "m.qpack", "--alias", "gpt-4o", "--alias", "qwen", "--strict-model",
        "--cors-origin", "http://localhost:3000", "--port", "9000"])
    cfg = config_from_dict({"model": {"path": "m.qpack"}}, overrides=server_overrides(args),
                           check_paths=False)
    assert cfg.server.aliases == ("gpt-4o", "qwen") and cfg.server.strict_model
    assert cfg.server.cors_origins == ("http://localhost:3000",) and cfg.server.port == 9000
    plain = build_parser().parse_args(["serve", "m.qpack"])
    cfg = config_from_dict({"model": {"path": "m.qpack"}}, overrides=server_overrides(plain),
                           check_paths=False)
    assert cfg.server.aliases == () and not cfg.server.strict_model and not cfg.server.cors_origins


@pytest.fixture(scope="module")
def thinking_container(synth_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qpack.writer import pack

    out = tmp_path_factory.mktemp("conformance-thinking") / "think.qpack"
    pack(synth_checkpoint("qwen3_5_moe"), out, bits=None, progress=False)
    return out


async def test_thinking_switch_and_constraints_on_a_thinking_template(
        thinking_container: Path) -> None:
    async with running(thinking_container) as (engine, base):
        v1 = client(f"{base}/v1")
        kw: dict[str, Any] = {"model": "think", "messages": USER, "max_tokens": 4, "seed": 3}
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
        off = await claude.messages.create(model="think", max_tokens=2, messages=USER,
                                           thinking={"type": "disabled"})
        assert off.usage.input_tokens + off.usage.cache_read_input_tokens == \
            plain.usage.prompt_tokens
        # Constrained output is the reply's content, not reasoning, even with thinking on.
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        for extra in ({}, {"chat_template_kwargs": {"enable_thinking": True}}):
            one = await v1.chat.completions.create(model="think", messages=USER,
                                                   max_tokens=60, seed=1,
                                                   response_format=fmt, extra_body=extra)
            check_weather(json.loads(one.choices[0].message.content))
