"""What agents and chat apps expect of the OpenAI routes, driven by the official client.

The peer-suite idea (llama.cpp's and mlx-lm's server tests) kept in-house: each feature
through the `openai` client, streaming and not. The model has random weights, which
makes constrained decoding a strong test: nothing but the grammar keeps its output valid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from helpers_conformance import TOOLS, USER, WEATHER, check_weather, client, running


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


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
            # No model at all: the reply names the first --alias, as llama.cpp's does.
            resp = await http.post("/v1/chat/completions", json=kw)
            assert resp.status_code == 200 and resp.json()["model"] == "moe-chat"

            # Tokenize (vLLM and llama.cpp forms) and back.
            tok = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
            assert tok["count"] == len(tok["tokens"]) == len(engine.encode("Hello world"))
            assert (await http.post("/v1/tokenize", json={"content": "Hello world"})).json()[
                "tokens"] == tok["tokens"]
            back = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            assert back["prompt"] == back["content"] == "Hello world"
            chat_tok = (await http.post("/tokenize", json={"messages": USER})).json()
            assert chat_tok["count"] == one.usage.prompt_tokens
            # With tools, the prompt the chat request would render (the template lists them).
            with_tools = (await http.post("/tokenize", json={"messages": USER, "tools": TOOLS})).json()
            assert with_tools["count"] > chat_tok["count"]

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

        # Legacy completions: logprobs=k, echo puts the prompt first, with the model's own
        # log-probabilities for every prompt token but the first (which has no context).
        prompt = "The weather in Paris"
        text = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                           temperature=0, logprobs=2, echo=True)
        choice = text.choices[0]
        n_prompt = len(engine.encode(prompt))
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset[n_prompt] == len(prompt)
        # The prompt's numbers agree with the decode path's: echo the prompt plus its first
        # greedy token, and that token's prompt log-probability is the one it was sampled
        # with (prefill over all positions vs one decode step; rounding may differ).
        ids = engine.encode(prompt)
        again = await v1.completions.create(model="tiny", prompt=ids + [engine.encode(lp.tokens[n_prompt])[0]],
                                            max_tokens=1, temperature=0, logprobs=0, echo=True)
        assert again.choices[0].logprobs.token_logprobs[n_prompt] == pytest.approx(
            lp.token_logprobs[n_prompt], abs=2e-3)
        # Scoring only (lm-eval-harness's loglikelihood): max_tokens=0 with echo and logprobs
        # gives the prompt's log-probabilities and no completion.
        scored = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=0,
                                             temperature=0, logprobs=2, echo=True)
        assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
        assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
        with pytest.raises(openai.BadRequestError):  # without logprobs there is nothing to score
            await v1.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
        streamed = [c async for c in await v1.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
            stream=True)]
        head = streamed[0].choices[0]
        assert head.text == prompt and head.logprobs.token_logprobs[1:] == lp.token_logprobs[1:n_prompt]

        # logit_bias: +100 on one token makes greedy pick it every time; -100 bans it.
        token = engine.encode(" London")[0]
        forced = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                             temperature=0, logit_bias={str(token): 100},
                                             logprobs=0)
        assert forced.choices[0].logprobs.tokens == [" London"] * 4
        # The first token keeps its leading space: prompt + text is what the model wrote.
        assert forced.choices[0].text == " London" * 4
        echoed = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                             temperature=0, logit_bias={str(token): 100},
                                             logprobs=1, echo=True)
        assert echoed.choices[0].text == prompt + " London London" == "".join(
            echoed.choices[0].logprobs.tokens)
        said = await v1.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                                temperature=0, logit_bias={str(token): 100})
        assert said.choices[0].message.content == " London London"
        streamed_chat = [c async for c in await v1.chat.completions.create(
            model="tiny", messages=USER, max_tokens=2, temperature=0,
            logit_bias={str(token): 100}, stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in streamed_chat
                       if c.choices) == " London London"
        free = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                           temperature=0, logprobs=0)
        first = engine.encode(free.choices[0].text)[0]
        banned = await v1.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                             temperature=0, logit_bias={str(first): -100})
        assert banned.choices[0].text != free.choices[0].text


async def test_constrained_decoding_json_and_tool_calls(container: Path) -> None:
    async with running(container) as (engine, base):
        v1 = client(f"{base}/v1")
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
        for seed in range(2):
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

        # tool_choice required: a call to a listed tool, arguments per its schema. One call
        # each (parallel_tool_calls false) keeps the grammar, and so the reply, bounded.
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
            tool_choice=named, parallel_tool_calls=False, stream=True)]
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
        # A $ref that loops on itself describes no value: a 400, not an empty 200.
        loops = ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                 "$ref": "#/$defs/a"}, {"anyOf": [{"$ref": "#"}]})
        for schema in loops:
            with pytest.raises(openai.BadRequestError) as bad:
                await v1.chat.completions.create(
                    model="tiny", messages=USER, max_tokens=5, response_format={
                        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            assert bad.value.body["param"] == "response_format", bad.value.body
            assert "the schema admits no value" in bad.value.body["message"]


def test_serve_flags_become_server_config() -> None:
    from pipeline.cli import build_parser
    from pipeline.cli.serve import server_overrides
    from pipeline.config.loading import config_from_dict

    args = build_parser().parse_args([
        "serve", "m.qpack", "--alias", "gpt-4o", "--alias", "qwen", "--strict-model",
        "--cors-origin", "http://localhost:3000", "--port", "9000",
        "--prefix-cache-dir", "/tmp/prefixes"])
    cfg = config_from_dict({"model": {"path": "m.qpack"}}, overrides=server_overrides(args),
                           check_paths=False)
    assert cfg.server.aliases == ("gpt-4o", "qwen") and cfg.server.strict_model
    assert cfg.server.cors_origins == ("http://localhost:3000",) and cfg.server.port == 9000
    assert cfg.server.prefix_cache_dir == "/tmp/prefixes"
    plain = build_parser().parse_args(["serve", "m.qpack"])
    cfg = config_from_dict({"model": {"path": "m.qpack"}}, overrides=server_overrides(plain),
                           check_paths=False)
    assert cfg.server.aliases == () and not cfg.server.strict_model and not cfg.server.cors_origins
    assert cfg.server.prefix_cache_dir is None
