"""Forced tool calls (`tool_choice` required or named) as a grammar in the markup the
container's own chat template writes calls in.

A model is trained on its template's markup; forcing another family's markup on it (Qwen's
JSON `<tool_call>` on GLM, or on DeepSeek and gpt-oss, whose vocabularies have no such
token at all) asks for text it has never written. So the style is read off the template
itself (`call_style`: it renders one assistant call and looks at what came out), and the
grammar writes exactly that markup, the arguments constrained to the tool's schema:

- json (Qwen3, Qwen3-Next): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- xml (Qwen3.5/3.6, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`
- kv (GLM-4.5/4.6): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n
  </tool_call>`
- sep (DeepSeek-V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜><｜tool▁calls▁end｜>`
- sep-fenced (DeepSeek-V3 / V3-0324 / R1): the same block, each call `function<｜tool▁sep｜>NAME
  \n```json\n{...}\n```` and the calls apart by a newline
- harmony (gpt-oss): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
  {...}<|call|>` (one call: `<|call|>` ends the turn, so parallel calls do not exist)
- kimi (Kimi-K2): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>` (later
  parallel calls numbered on from 1)

The xml and kv styles write values bare, as the templates do: a string as its text (no `<`
in it: the closing tag is what ends it), an enum of strings as one of them, anything else
as JSON; the server types them back from the schema (call_formats.typed_value). Markup
tokens are named as tokens (`<tool_call>`), the way the model writes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.server.grammar import closed, compact_json

Tool = tuple[str, dict[str, Any] | None]  # (name, parameters schema)
STYLES = ("json", "xml", "kv", "sep", "sep-fenced", "harmony", "kimi")
NEWLINE = "\n"
_PROBE_NAME, _PROBE_KEY = "probe_call", "probe_key"
_PROBE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {_PROBE_KEY: {"type": "string"}}, "required": [_PROBE_KEY]}}}]
_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function", "function": {
        "name": _PROBE_NAME, "arguments": {_PROBE_KEY: "probe_value"}}}]}]
# Markers of each style in a rendered call, most specific first (json is what is left).
_MARKERS = (("sep-fenced", f"function<｜tool▁sep｜>{_PROBE_NAME}"), ("sep", "<｜tool▁sep｜>"),
            ("kimi", "<|tool_call_argument_begin|>"),
            ("harmony", f"to=functions.{_PROBE_NAME}"), ("kv", f"<arg_key>{_PROBE_KEY}</arg_key>"),
            ("xml", f"<function={_PROBE_NAME}>"))
_STYLES: dict[tuple[int, str], str] = {}


def call_style(tokenizer: Any) -> str:
    """The markup the tokenizer's chat template writes an assistant's tool call in (one of
    STYLES; json where the template renders no call at all). Renders the template: run it
    off the event loop. Cached per tokenizer and template."""
    from pipeline.server.prompting import render
    from pipeline.server.schema import APIError

    key = (id(tokenizer), str(getattr(tokenizer, "chat_template", "")))
    if key not in _STYLES:
        try:
            text = render(tokenizer, _PROBE, _PROBE_TOOLS, {}, add_generation_prompt=False).text
        except APIError:  # a template that refuses the probe: the style most templates use
            text = ""
        _STYLES[key] = next((style for style, marker in _MARKERS if marker in text), "json")
    return _STYLES[key]


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _bare(schema: Any, nl: str) -> str:
    """A parameter value as the xml / kv templates write it (see the module docstring),
    `nl` on either side of it (xml's newlines): inside the value's own terminal, since a
    bare string runs up to the next `<` and would otherwise swallow the newline after it."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lit(nl + v + nl) for v in enum) + ")"
    if schema.get("type") == "string" and "const" not in schema:
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        count = "*"
        if isinstance(lo, int) or isinstance(hi, int):
            count = f"{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}"
        edge = json.dumps(nl)[1:-1]  # the newline as the regex writes it
        return f"/{edge}[^<]{count}{edge}/"
    inner = f"%json {json.dumps(compact_json(closed(schema)))}"
    return f"{_lit(nl)} {inner} {_lit(nl)}" if nl else inner


def _arguments(params: dict[str, Any] | None, pair: str, nl: str = "") -> str:
    """The parameters in schema order, each once: required ones always, the rest optional
    (`pair` formats one: `{key}` and `{value}`); additional keys are not offered."""
    props = (params or {}).get("properties")
    required = set((params or {}).get("required") or [])
    if not isinstance(props, dict):
        return '""'
    parts = [("" if k in required else "(") + pair.format(key=_lit(k), value=_bare(v, nl))
             + ("" if k in required else ")?") for k, v in props.items()]
    return " ".join(parts) or '""'


def _json_args(params: dict[str, Any] | None) -> str:
    return f"%json {json.dumps(compact_json(closed(params) if params is not None else {'type': 'object'}))}"


def _json_call(tools: Sequence[Tool]) -> str:
    """Qwen's JSON body, one schema for every tool (`name` tells them apart)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             "arguments": closed(params) if params is not None else {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return f'call: <tool_call> "\\n" %json {json.dumps(compact_json(schema))} "\\n" </tool_call>'


def _xml(name: str, params: dict[str, Any] | None, index: str) -> str:
    pair = '"<parameter=" {key} ">" {value} "</parameter>\\n"'
    return (f'<tool_call> "\\n<function=" {_lit(name)} ">\\n" {_arguments(params, pair, NEWLINE)} '
            f'"</function>\\n" </tool_call>')


def _kv(name: str, params: dict[str, Any] | None, index: str) -> str:
    pair = '<arg_key> {key} </arg_key> "\\n" <arg_value> {value} </arg_value> "\\n"'
    return f'<tool_call> {_lit(name)} "\\n" {_arguments(params, pair)} </tool_call>'


def _sep(name: str, params: dict[str, Any] | None, index: str) -> str:
    return f"<｜tool▁call▁begin｜> {_lit(name)} <｜tool▁sep｜> {_json_args(params)} <｜tool▁call▁end｜>"


def _sep_fenced(name: str, params: dict[str, Any] | None, index: str) -> str:
    return (f'<｜tool▁call▁begin｜> "function" <｜tool▁sep｜> {_lit(name + NEWLINE + "```json" + NEWLINE)} '
            f'{_json_args(params)} "\\n```" <｜tool▁call▁end｜>')


def _harmony(name: str, params: dict[str, Any] | None, index: str) -> str:
    return (f'<|channel|> {_lit(f"commentary to=functions.{name} ")} <|constrain|> "json" <|message|> '
            f"{_json_args(params)} <|call|>")


def _kimi(name: str, params: dict[str, Any] | None, index: str) -> str:
    return (f"<|tool_call_begin|> {_lit(f'functions.{name}:')} {index} <|tool_call_argument_begin|> "
            f"{_json_args(params)} <|tool_call_end|>")


# One call's markup by style; `index` is the call's place in the turn as a Lark expression
# (only Kimi writes it, in the call's id).
_CALLS = {"xml": _xml, "kv": _kv, "sep": _sep, "sep-fenced": _sep_fenced, "harmony": _harmony, "kimi": _kimi}
_LINES = ' ("\\n" call)*'
# How each style frames its calls: the start rule (`{more}`: where parallel calls go) and
# what a further call is. DeepSeek's and Kimi's calls sit in one section; GLM's template
# puts a newline after `<think></think>`; gpt-oss writes one call a turn (`<|call|>` ends
# it); the rest are calls a line apart.
_FRAMES = {
    "sep": ("<｜tool▁calls▁begin｜> call{more} <｜tool▁calls▁end｜>", " call*"),
    "sep-fenced": ("<｜tool▁calls▁begin｜> call{more} <｜tool▁calls▁end｜>", _LINES),
    "kimi": ("<|tool_calls_section_begin|> call{more} <|tool_calls_section_end|>", " later*"),
    "harmony": ("call{more}", ""),
    "kv": ('"\\n"? call{more}', _LINES),
}
# Kimi's ids count the turn's calls from 0: the first is 0, a later one up to 99 (a bound:
# a random model held to digits alone could write them until max_tokens).
_FIRST, _LATER = '"0"', "/[1-9][0-9]?/"


def tool_grammar(tools: Sequence[Tool], parallel: bool, style: str = "json") -> str:
    """One or more calls in `style`, each naming one of `tools` with matching arguments."""
    import llguidance

    frame, more = _FRAMES.get(style, ("call{more}", _LINES))
    more = more if parallel else ""
    if style == "json":
        rules = [_json_call(tools)]
    elif style in _CALLS:
        body = _CALLS[style]
        rules = []
        for rule, index in (("call", _FIRST), ("later", _LATER)):
            if rule == "call" or "later" in more:
                rules += [f"{rule}: " + " | ".join(f"{rule}_{i}" for i in range(len(tools))),
                          *(f"{rule}_{i}: {body(name, params, index)}" for i, (name, params) in enumerate(tools))]
    else:
        raise ValueError(f"unknown tool-call style {style!r}; one of {', '.join(STYLES)}")
    start = "start: " + frame.format(more=more)
    return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n")
