"""What llama.cpp's clients and its server test suite send: `response_format` json_object
with a schema, a top-level `json_schema`, a GBNF `grammar`, `/tokenize` with
`with_pieces`, forced tool calls whose parameters leave `additionalProperties` unsaid;
and what they read back: `system_fingerprint`, the `--alias` as the model's name.

The request bodies are those of llama.cpp's `tools/server/tests/unit/` (test_chat_completion,
test_tool_call, test_tokenize), sent over plain HTTP as that suite does, and through the
official openai client where it has the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx2
import pytest
from helpers_conformance import client, running

from pipeline.server import call_grammar, grammar

SYSTEM = [{"role": "system", "content": "You are a coding assistant."},
          {"role": "user", "content": "Write an example"}]

# llama.cpp's test_tool_call.py TEST_TOOL: no additionalProperties.
TEST_TOOL = {"type": "function", "function": {"name": "test", "description": "", "parameters": {
    "type": "object", "properties": {"success": {"type": "boolean", "const": True}},
    "required": ["success"]}}}


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def test_closed_fills_in_only_what_is_unsaid() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "any": {"type": "object"},
        "list": {"type": "array", "items": {"properties": {"c": {}}}}},
        "allOf": [{"properties": {"x": {}}}], "$defs": {"d": {"properties": {"e": {}}}}}
    out = grammar.closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]  # any object stays any object
    assert props["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # would forbid the other members' keys
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is not edited
    # llama.cpp reads types from the keywords, and a list of `items` as a tuple.
    assert grammar.closed({"items": [{"type": "integer"}]}) == {
        "type": "array", "prefixItems": [{"type": "integer"}]}
    assert grammar.closed({"properties": {}})["type"] == "object"
    assert "type" not in grammar.closed({"anyOf": [{"items": {}}]})


async def test_what_llama_cpp_clients_send(container: Path) -> None:
    async with running(container, aliases=("my-alias",)) as (engine, base), \
            httpx2.AsyncClient(base_url=base, timeout=120) as http:

        async def chat(**body: Any) -> httpx2.Response:
            return await http.post("/chat/completions", json={"messages": SYSTEM, **body})

        # test_completion_with_response_format: a json_object's schema is honoured.
        for fmt, n, pattern in (
                ({"type": "json_object", "schema": {"const": "42"}}, 6, r'^"42"$'),
                ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, 10,
                 r'^"foooooo"$')):
            res = await chat(max_tokens=n, response_format=fmt)
            assert res.status_code == 200, res.text
            assert re.match(pattern, res.json()["choices"][0]["message"]["content"])
        # Draft-4 tuple `items`: the array's first item an integer (llama.cpp: "[ -3000 ]").
        ints = await chat(max_tokens=10, response_format={
            "type": "json_object", "schema": {"items": [{"type": "integer"}]}})
        assert ints.status_code == 200, ints.text
        content = ints.json()["choices"][0]["message"]["content"]
        assert re.match(r"^\[-?\d", content), content
        for bad in ({"type": "sound"}, {"type": "json_object", "schema": 123},
                    {"type": "json_object", "schema": {"type": 123}},
                    {"type": "json_object", "schema": {"type": "hiccup"}}):
            res = await chat(max_tokens=2, response_format=bad)
            assert res.status_code == 400 and "error" in res.json(), bad
        # test_completion_with_json_schema and test_completion_with_grammar: top-level fields.
        res = await chat(max_tokens=6, json_schema={"const": "42"})
        assert res.json()["choices"][0]["message"]["content"] == '"42"'
        res = await chat(max_tokens=6, grammar='root ::= "a"{5,5}')
        assert res.json()["choices"][0]["message"]["content"] == "aaaaa"
        res = await http.post("/v1/completions", json={"prompt": "I believe", "max_tokens": 6,
                                                       "grammar": 'root ::= ("yes" | "no")'})
        assert res.json()["choices"][0]["text"] in ("yes", "no")
        for body in ({"grammar": "root ::= ("}, {"grammar": 'root ::= "a"',
                                                  "json_schema": {"const": 1}}):
            res = await chat(max_tokens=2, **body)
            assert res.status_code == 400 and res.json()["error"]["param"] in (
                "grammar", "json_schema"), res.text

        # test_tool_call.py: a forced call to a tool whose schema leaves objects open by
        # omission closes them, so the call ends instead of growing keys to max_tokens.
        v1 = client(f"{base}/v1")
        for choice in ("required", {"type": "function", "function": {"name": "test"}}):
            done = await v1.chat.completions.create(
                messages=SYSTEM, model="", tools=[TEST_TOOL], tool_choice=choice,
                parallel_tool_calls=False, max_tokens=64)
            c = done.choices[0]
            assert c.finish_reason == "tool_calls"
            assert json.loads(c.message.tool_calls[0].function.arguments) == {"success": True}
            # A request naming no model is answered with the first --alias, as llama.cpp does.
            assert done.model == "my-alias"
            assert re.fullmatch(r"fp_[0-9a-f]{16}", done.system_fingerprint)
        chunks = [c async for c in await v1.chat.completions.create(
            messages=SYSTEM, model="tiny", max_tokens=2, stream=True)]
        assert {c.system_fingerprint for c in chunks} == {done.system_fingerprint}
        assert chunks[0].model == "tiny"
        text = await v1.completions.create(prompt="Hi", model="tiny", max_tokens=1)
        assert text.system_fingerprint == done.system_fingerprint

        # test_tokenize.py: with_pieces gives each token's text, or its bytes when a token
        # holds part of a character; together they are the content.
        content = "What is the capital of France ? 私 👋"
        res = (await http.post("/tokenize", json={"content": content, "with_pieces": True})).json()
        pieces = res["tokens"]
        assert [p["id"] for p in pieces] == engine.encode(content)
        assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                        for p in pieces) == content.encode()
        assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji is split
        plain = (await http.post("/tokenize", json={"content": content})).json()
        assert plain["tokens"] == engine.encode(content)


def test_closed_tool_grammar_refuses_another_key(container: Path) -> None:
    """Token by token: after the declared key, the grammar allows the object's end, not `,`."""
    from pipeline.engine_parts import cached_tokenizer

    tok = cached_tokenizer(container)
    vocab = json.loads((container / "config.json").read_text())["vocab_size"]
    eos = list(tok.eos_token_ids)
    ll = grammar.tokenizer_for(container, vocab, eos)
    params = TEST_TOOL["function"]["parameters"]
    allowed = {}
    for label, schema in (("closed", params), ("open", {**params, "additionalProperties": True})):
        text = call_grammar.tool_grammar([("test", schema)], parallel=False)
        constraint = grammar.GrammarConstraint(ll, text, vocab, eos)
        for t in tok.encode('<tool_call>\n{"name":"test","arguments":{"success":true',
                            add_special_tokens=False):
            assert constraint.allowed()[t]
            constraint.advance(t)
        allowed[label] = constraint.allowed()
    def texts(mask: Any) -> set[str]:
        return {tok.decode([int(t)]) for t in mask.nonzero()[0]}

    # Only the object's end may follow (llguidance picks the canonical token, `}}\n`).
    assert texts(allowed["closed"]) and all(t.startswith("}") for t in texts(allowed["closed"]))
    assert "," in texts(allowed["open"])  # what the schema asks for explicitly stays open
