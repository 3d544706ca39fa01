"""Qwen3.5/3.6 XML-style tool calls: typed from the tool schema, streamed and whole, on text
rendered by the family's own chat template and tokenized by its real tokenizer."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.text_stream import TextStream
from pipeline.server.call_formats import parse_xml_call, typed_value
from pipeline.server.tool_calls import Call, Content, OutputParser, Reasoning, parse_output

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "threshold": {"type": "number"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object"},
        "zip": {"type": "string"},
        "limit": {"type": ["integer", "null"]},
        "note": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    },
    "required": ["city"],
}
SCHEMAS = {"get_weather": WEATHER, "noop": {"type": "object", "properties": {}}}

# What a Qwen3.6 thinking model writes after the generation prompt `<think>\n`.
MODEL_TEXT = (
    "The user asks about Paris for 3 days, metric. I should call get_weather.\n</think>\n\n"
    "I'll look that up.\n\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=threshold>\n0.5\n</parameter>\n"
    '<parameter=fields>\n["temp", "wind"]\n</parameter>\n'
    '<parameter=where>\n{"lat": 48.9, "lon": 2.35}\n</parameter>\n'
    "<parameter=zip>\n75001\n</parameter>\n"
    "<parameter=limit>\nnull\n</parameter>\n"
    "<parameter=note>\nline one\nline two\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
)
EXPECTED = {
    "city": "Paris", "days": 3, "metric": True, "threshold": 0.5, "fields": ["temp", "wind"],
    "where": {"lat": 48.9, "lon": 2.35}, "zip": "75001", "limit": None,
    "note": "line one\nline two",
}


def _check(content: str | None, reasoning: str | None, calls: list[Call]) -> None:
    assert reasoning is not None and reasoning.startswith("The user asks about Paris")
    assert content == "I'll look that up."
    assert [c.name for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0].arguments) == EXPECTED
    assert json.loads(calls[1].arguments) == {}


def test_whole_output_typed_from_schema() -> None:
    out = parse_output(MODEL_TEXT, in_reasoning=True, schemas=SCHEMAS)
    _check(out.content, out.reasoning, out.calls)


def test_without_a_schema_values_read_as_json_else_text() -> None:
    name, args = parse_xml_call("<function=f>\n<parameter=n>\n42\n</parameter>\n"
                                "<parameter=s>\nhello\n</parameter>\n</function>")
    assert (name, args) == ("f", {"n": 42, "s": "hello"})


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(MODEL_TEXT)), max_size=12))
def test_streaming_equals_whole(cuts: list[int]) -> None:
    parser = OutputParser(in_reasoning=True, schemas=SCHEMAS)
    parts, last = [], 0
    for cut in [*sorted(set(cuts)), len(MODEL_TEXT)]:
        parts += parser.feed(MODEL_TEXT[last:cut])
        last = cut
    parts += parser.finish()
    for p in parts:
        if isinstance(p, Content | Reasoning):
            assert "<parameter" not in p.text and "<function" not in p.text
    content = "".join(p.text for p in parts if isinstance(p, Content)).strip()
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    _check(content, reasoning, [p for p in parts if isinstance(p, Call)])


@pytest.mark.parametrize(
    "body",
    [
        "<function=f>\n<parameter=a>\n1\n</parameter>\nstray text\n</function>",  # text between
        "<function=f>\n<parameter=a>\n1\n",  # cut off inside a parameter
        "<function=>\n</function>",  # no name
        "<functions=f></functions>",
    ],
)
def test_not_a_call_is_passed_through(body: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    out = parse_output(text, schemas=SCHEMAS)
    assert out.calls == [] and out.content == text


def test_unclosed_tool_call_with_a_closed_function_counts() -> None:
    # Cut off by max_tokens right after </function>: the call is complete.
    out = parse_output("<tool_call>\n<function=noop>\n</function>\n", schemas=SCHEMAS)
    assert [c.name for c in out.calls] == ["noop"]


@pytest.mark.parametrize(
    "text, prop, expected",
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),  # does not fit: the model's text, not a guess
        ("7", {"type": "number"}, 7),
        ("1e3", {"type": "number"}, 1000.0),
        ("nan", {"type": "number"}, "nan"),
        ("True", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ("007", {"type": "string"}, "007"),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("{}", {"type": "array"}, "{}"),
        ("null", {"type": ["string", "null"]}, "null"),
        ("null", {"type": ["null", "string"]}, None),
        ("b", {"enum": ["a", "b"]}, "b"),
        ("12", None, 12),
        ('"quoted"', None, '"quoted"'),
    ],
)
def test_typed_value(text: str, prop: dict | None, expected: object) -> None:
    assert typed_value(text, prop) == expected


@pytest.fixture(scope="module")
def qwen35_tokenizer(synth_checkpoint, packed):
    """What an engine on the tiny Qwen3.5 container encodes with (mlx-lm's wrapper), the
    very object when this process has opened one (a load takes seconds)."""
    from pipeline.engine_parts import cached_tokenizer
    from qpack.reader import Container

    with Container.open(packed(synth_checkpoint("qwen3_5_moe"), bits=None)) as container:
        return cached_tokenizer(container.tokenizer_dir())


def test_template_rendered_calls_parse_back_token_by_token(qwen35_tokenizer) -> None:
    """The family's own template renders an assistant turn with calls; its text, decoded
    token by token as the model would stream it, parses back to the same typed arguments."""
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "I'll look that up.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": EXPECTED}},
                        {"type": "function", "function": {"name": "noop", "arguments": {}}}]},
    ]
    rendered = qwen35_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    reply = re.search(r"<\|im_start\|>assistant\n<think>\n(.*?)<\|im_end\|>", rendered, re.S)
    assert reply is not None and "<function=get_weather>" in reply[1]
    ids = qwen35_tokenizer.encode(reply[1], add_special_tokens=False)
    detok = qwen35_tokenizer.detokenizer
    detok.reset()
    chain = TextStream(detok, ())
    parser = OutputParser(in_reasoning=True, schemas=SCHEMAS)
    parts = []
    for token in ids:
        delta, _ = chain.add(token)
        parts += parser.feed(delta)
    parts += parser.feed(chain.finish()) + parser.finish()
    content = "".join(p.text for p in parts if isinstance(p, Content)).strip()
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning)).strip()
    calls = [p for p in parts if isinstance(p, Call)]
    assert reasoning == "Use the tool." and content == "I'll look that up."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", EXPECTED), ("noop", {})]
