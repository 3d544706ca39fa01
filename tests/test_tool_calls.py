"""The output parser: tool calls, reasoning, held-back tags; and the streamed-text chain on real tokens."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.text_stream import TextStream
from pipeline.server.tool_calls import (
    Call,
    Content,
    OutputParser,
    Reasoning,
    parse_call,
    parse_output,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def stream(text: str, cuts: list[int], **kw: bool) -> list:
    parser = OutputParser(**kw)
    parts, last = [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        parts += parser.feed(text[last:cut])
        last = max(last, cut)
    return parts + parser.finish()


def test_whole_output_with_a_call() -> None:
    out = parse_output("Let me check.\n" + CALL)
    assert out.content == "Let me check."
    assert out.reasoning is None
    [call] = out.calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    assert call.id.startswith("call_") and call.index == 0


def test_two_calls_and_no_content() -> None:
    text = CALL + "\n" + CALL.replace("Paris", "Oslo")
    out = parse_output(text)
    assert out.content is None
    assert [json.loads(c.arguments)["city"] for c in out.calls] == ["Paris", "Oslo"]
    assert [c.index for c in out.calls] == [0, 1]
    assert out.calls[0].id != out.calls[1].id


def test_not_json_is_kept_as_content() -> None:
    text = "a <tool_call>{not json}</tool_call> b"
    out = parse_output(text)
    assert out.calls == [] and out.content == text


def test_unclosed_call_at_the_end() -> None:
    # Cut off by max_tokens: complete JSON still counts, a fragment is passed through as text.
    assert parse_output('<tool_call>{"name": "f", "arguments": {}}').calls[0].name == "f"
    out = parse_output('x <tool_call>{"name": "f", "argu')
    assert out.calls == [] and out.content == 'x <tool_call>{"name": "f", "argu'
    # ... unless the output was cut at max_tokens: the unfinished call is dropped, not shown.
    parser = OutputParser()
    parts = parser.feed('x <tool_call>{"name": "f", "argu') + parser.finish(cut=True)
    assert "".join(p.text for p in parts if isinstance(p, Content)) == "x " and not parser.calls


def test_a_harmony_call_cut_at_max_tokens_is_dropped_not_shown() -> None:
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"city\": \"Par"
    parser = OutputParser()
    assert [p for p in parser.feed(text) + parser.finish(cut=True) if isinstance(p, Content)] == []
    parser = OutputParser()
    assert "".join(p.text for p in parser.feed(text) + parser.finish() if isinstance(p, Content))


def test_tools_off_leaves_calls_as_text() -> None:
    out = parse_output(CALL, tools=False)
    assert out.calls == [] and out.content == CALL


def test_reasoning_split() -> None:
    out = parse_output("<think>hmm, weather</think>\n\nIt is sunny.")
    assert out.reasoning == "hmm, weather"
    assert out.content == "\n\nIt is sunny."
    # Thinking templates open <think> in the prompt: the output starts inside it.
    out = parse_output("plan: call it</think>" + CALL, in_reasoning=True)
    assert out.reasoning == "plan: call it"
    assert out.calls[0].name == "get_weather" and out.content is None


@pytest.mark.parametrize(
    "body, expected",
    [
        ('{"name": "f", "arguments": {"a": 1}}', ("f", '{"a": 1}')),
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', ("f", '{"a": 1}')),
        ('{"name": "f", "parameters": {"a": 1}}', ("f", '{"a": 1}')),
        ('{"name": "f"}', ("f", "{}")),
        ('{"name": "", "arguments": {}}', None),
        ('{"arguments": {}}', None),
        ('["f"]', None),
        ('{"name": "f", "arguments": [1]}', None),
    ],
)
def test_parse_call(body: str, expected: tuple[str, str] | None) -> None:
    assert parse_call(body) == expected


def test_never_emits_part_of_a_tag_streaming_char_by_char() -> None:
    text = "<think>why</think>Hi <tool_x> and <tool_cal> " + CALL + " bye <"
    parser = OutputParser(tools=True)
    emitted = []
    for ch in text:
        for part in parser.feed(ch):
            emitted.append(part)
            if isinstance(part, Content | Reasoning):
                for tag in TAGS:
                    assert tag not in part.text
    emitted += parser.finish()
    content = "".join(p.text for p in emitted if isinstance(p, Content))
    # The space before the call is dropped with it (as the "\n" between two calls is).
    assert content == "Hi <tool_x> and <tool_cal> bye <"
    assert "".join(p.text for p in emitted if isinstance(p, Reasoning)) == "why"
    assert [p.name for p in emitted if isinstance(p, Call)] == ["get_weather"]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["a", " ", "\n", "<", ">", "<think>", "</think>", "é👋",
                                     CALL, "<tool_call>", "</tool_call>", "tool_call"]),
                    max_size=12),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_streaming_matches_whole_text(pieces: list[str], cuts: list[int]) -> None:
    """However the text is cut into deltas, the parts add up to the one-shot parse."""
    text = "".join(pieces)
    whole = parse_output(text)
    parts = stream(text, [c for c in cuts if c <= len(text)])
    calls = [p for p in parts if isinstance(p, Call)]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    assert reasoning == (whole.reasoning or "")
    content = "".join(p.text for p in parts if isinstance(p, Content))
    assert (content.strip() if calls else content) == (whole.content or "")
    one_shot = OutputParser()
    whole_parts = one_shot.feed(text) + one_shot.finish()
    assert content == "".join(p.text for p in whole_parts if isinstance(p, Content))


@pytest.fixture(scope="module")
def qwen_tokenizer(synth_checkpoint):
    from mlx_lm.utils import load_tokenizer

    # The synthetic checkpoint carries the real Qwen3-Next tokenizer files.
    return load_tokenizer(synth_checkpoint("qwen3_next"))


@pytest.mark.parametrize("stops", [(), ("世",), ("🏽 世",)])
def test_token_by_token_chain_keeps_characters_whole(qwen_tokenizer, stops: tuple[str, ...]) -> None:
    """Ids of multi-byte text, one at a time, through detokenizer + StopMatcher + parser."""
    text = "héllo 👋🏽 世界 <tool_call>\n" + '{"name": "f", "arguments": {"q": "日本"}}' + "\n</tool_call>"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE splits the emoji and CJK into several ids, so partial bytes do occur.
    assert len(ids) > len(text.split())
    detok = qwen_tokenizer.detokenizer
    detok.reset()
    chain = TextStream(detok, stops)
    parser = OutputParser(tools=True)
    deltas: list[str] = []
    parts = []
    for token in ids:
        delta, finish = chain.add(token)
        deltas.append(delta)
        parts += parser.feed(delta)
        if finish:
            break
    tail = chain.finish()
    deltas.append(tail)
    parts += parser.feed(tail) + parser.finish()
    for d in deltas:
        assert "\ufffd" not in d
        d.encode("utf-8")  # a lone surrogate would raise
    cut = min((text.index(s) for s in stops), default=len(text))
    assert "".join(deltas) == text[:cut]
    content = "".join(p.text for p in parts if isinstance(p, Content))
    calls = [p for p in parts if isinstance(p, Call)]
    if not stops:
        assert content == "héllo 👋🏽 世界"
        assert [json.loads(c.arguments) for c in calls] == [{"q": "日本"}]
    else:
        assert content == text[:cut] and calls == []
