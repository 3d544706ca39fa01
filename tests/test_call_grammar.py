"""Forced tool calls in each family's own markup: the style read off the chat template the
family ships (qpack/synth/templates), a grammar that accepts, token by token on the
family's real tokenizer, what that model writes for a call, and the server's output parser
reading it back into the call. The served round trips (tests/helpers_family.py) force
calls through the real server with the official openai and anthropic clients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_family import parse_streamed

from pipeline.engine_parts import cached_tokenizer
from pipeline.server import call_grammar, grammar

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOLS = [("get_weather", SCHEMA), ("get_time", None)]
CALL = {"city": "Paris", "days": 2, "unit": "celsius"}
# What each family's model writes for that call after the generation prompt (without
# reasoning: a forced call turns thinking off), as its template renders calls.
WRITTEN = {
    "qwen3_moe": ("json", '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2,'
                          '"unit":"celsius"}}\n</tool_call>'),
    "qwen3_5_moe": ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                           "<parameter=days>\n2\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
                           "</function>\n</tool_call>"),
    "glm4_moe": ("kv", "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                       "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>unit</arg_key>\n"
                       "<arg_value>celsius</arg_value>\n</tool_call>"),
    "deepseek_v3": ("sep", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris",'
                           '"days":2,"unit":"celsius"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "gpt_oss": ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                           '{"city":"Paris","days":2,"unit":"celsius"}<|call|>'),
    "kimi-k2": ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                        '<|tool_call_argument_begin|>{"city":"Paris","days":2,"unit":"celsius"}<|tool_call_end|>'
                        "<|tool_calls_section_end|>"),
}
# Kimi-K2 is deepseek_v3's architecture at its kimi presets (Kimi's tokenizer and chat).
SOURCES = {"kimi-k2": ("deepseek_v3", "kimi-tiny")}


@pytest.fixture(scope="module")
def containers(synth_checkpoint, packed):
    """The containers the family tests build anyway (only the tokenizer and template matter)."""
    def make(key: str) -> Path:
        family, preset = SOURCES.get(key, (key, "tiny"))
        return packed(synth_checkpoint(family, preset=preset), bits=None if family == "qwen3_5_moe" else 16)

    return make


def _constraint(root: Path, tok, style: str, parallel: bool = False) -> grammar.GrammarConstraint:
    config = json.loads((root / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    eos = list(tok.eos_token_ids)
    text = call_grammar.tool_grammar(TOOLS, parallel=parallel, style=style)
    return grammar.GrammarConstraint(grammar.tokenizer_for(root, vocab, eos), text, vocab, eos)


@pytest.mark.parametrize("family", list(WRITTEN))
def test_the_forced_grammar_writes_the_family_markup_the_parser_reads(containers, family):
    root = containers(family)
    tok = cached_tokenizer(root)
    style, written = WRITTEN[family]
    assert call_grammar.call_style(tok) == style
    constraint = _constraint(root, tok, style)
    for t in tok.encode(written, add_special_tokens=False):
        assert constraint.allowed()[t], (family, tok.decode([t]))
        constraint.advance(t)
    assert constraint.matcher.is_accepting()
    _reasoning, content, calls = parse_streamed(root, written, in_reasoning=False)
    assert content == "" and calls == [("get_weather", CALL)]


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_5_moe"])
def test_bare_values_keep_to_the_schema(containers, family):
    """xml / kv write values bare: an enum offers only its strings, a string stops at its
    maxLength and at the closing tag, an undeclared key is never offered."""
    root = containers(family)
    tok = cached_tokenizer(root)
    style, written = WRITTEN[family]
    constraint = _constraint(root, tok, style)
    cut = written.index("celsius")
    for t in tok.encode(written[:cut], add_special_tokens=False):
        constraint.advance(t)
    offered = {tok.decode([int(t)]) for t in constraint.allowed().nonzero()[0]}
    assert offered and all("celsius".startswith(o) or "fahrenheit".startswith(o) for o in offered)
    constraint = _constraint(root, tok, style)
    over = written.replace("Paris", "Parisian")  # 8 characters > maxLength 6
    accepted = True
    for t in tok.encode(over, add_special_tokens=False):
        if not constraint.allowed()[t]:
            accepted = False
            break
        constraint.advance(t)
    assert not accepted


def test_deepseek_parallel_calls_share_one_block(containers):
    root = containers("deepseek_v3")
    tok = cached_tokenizer(root)
    one = '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
    written = "<｜tool▁calls▁begin｜>" + one + one + "<｜tool▁calls▁end｜>"
    constraint = _constraint(root, tok, "sep", parallel=True)
    for t in tok.encode(written, add_special_tokens=False):
        assert constraint.allowed()[t]
        constraint.advance(t)
    assert constraint.matcher.is_accepting()
    assert parse_streamed(root, written, in_reasoning=False)[2] == [("get_time", {}), ("get_time", {})]


def test_kimi_parallel_calls_share_one_section_and_count_on(containers):
    """Kimi's ids number the turn's calls: the first 0, the later ones on from 1."""
    root = containers("kimi-k2")
    tok = cached_tokenizer(root)
    written = "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.get_time:{i}<|tool_call_argument_begin|>{{}}<|tool_call_end|>"
        for i in range(2)) + "<|tool_calls_section_end|>"
    constraint = _constraint(root, tok, "kimi", parallel=True)
    for t in tok.encode(written, add_special_tokens=False):
        assert constraint.allowed()[t], tok.decode([t])
        constraint.advance(t)
    assert constraint.matcher.is_accepting()
    assert parse_streamed(root, written, in_reasoning=False)[2] == [("get_time", {}), ("get_time", {})]
    # A second call numbered 0 again is not what the model writes: refused.
    constraint = _constraint(root, tok, "kimi", parallel=True)
    ids = tok.encode(written.replace("get_time:1", "get_time:0"), add_special_tokens=False)
    assert not all(constraint.allowed()[t] and constraint.advance(t) is None for t in ids)


def test_an_unknown_style_is_one_line():
    with pytest.raises(ValueError, match="unknown tool-call style 'yaml'; one of json, xml, kv, sep, sep-fenced, harmony, kimi"):
        call_grammar.tool_grammar(TOOLS, parallel=False, style="yaml")


# DeepSeek-V3-0324 / R1's template writes a call as `type<｜tool▁sep｜>name` and the
# arguments (JSON text) in a ```json fence, calls apart by a newline (their released
# template, cut to its tool-call lines).
FENCED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.tool_calls %}"
    "<｜Assistant｜><｜tool▁calls▁begin｜>{% for t in m.tool_calls %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>' + t.type + '<｜tool▁sep｜>' + t.function.name + '\\n```json\\n' + t.function.arguments"
    " + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def test_deepseek_r1_fenced_calls_are_forced_as_its_template_writes_them(containers):
    import copy

    root = containers("deepseek_v3")
    tok = copy.copy(cached_tokenizer(root))
    tok.chat_template = FENCED_TEMPLATE
    assert call_grammar.call_style(tok) == "sep-fenced"
    one = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city":"Paris","days":2,"unit":"celsius"}\n```<｜tool▁call▁end｜>'
    written = "<｜tool▁calls▁begin｜>" + one + "\n" + one + "<｜tool▁calls▁end｜>"
    constraint = _constraint(root, tok, "sep-fenced", parallel=True)
    for t in tok.encode(written, add_special_tokens=False):
        assert constraint.allowed()[t], tok.decode([t])
        constraint.advance(t)
    assert constraint.matcher.is_accepting()
    assert parse_streamed(root, written, in_reasoning=False)[2] == [("get_weather", CALL)] * 2
