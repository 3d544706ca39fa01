"""The ways models write the body of a `<tool_call>` block, parsed to OpenAI's form.

- JSON (Qwen3, Qwen3-Next): `{"name": "f", "arguments": {"city": "Paris"}}`.
- XML (Qwen3.5/3.6, Qwen3-Coder): `<function=f>\n<parameter=city>\nParis\n</parameter>\n
  </function>`. Values are bare text, so their types come from the tool's JSON schema
  (`parameters.properties[name].type`): "3" is the integer 3 for an `integer` parameter and
  the string "3" for a `string` one. This follows what the released chat templates render
  (strings as they are, everything else as JSON) and what vLLM's qwen3_coder parser reads.
- Key/value tags (GLM-4.5/4.6): `NAME\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n`,
  values typed from the schema the same way (vLLM's glm45 parser reads them so).

- Separator (DeepSeek-V3.1): `NAME<｜tool▁sep｜>{"city": "Paris"}`; V3-0324 / R1 wrote
  `function<｜tool▁sep｜>NAME` then the arguments in a ```json fence, read too.
- Kimi-K2: `functions.NAME:0<|tool_call_argument_begin|>{"city": "Paris"}` (the call's id,
  `functions.` + name + `:` + its index in the turn, then the arguments).

Which style a family writes is fixed by its chat template, but every style is accepted for
every family: a body is unambiguous (JSON starts with `{`, XML with `<function=`, key/value
tags with a bare name), and a fine-tune that drifts to another style still gets its call
through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> its `parameters` JSON schema

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_KV_NAME = re.compile(r"\s*([\w.\-]+)\s*(?=<arg_key>|\Z)")  # tool names: letters, digits, _ - .
_KV_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def held_suffix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `tags`: the
    text a streaming parser holds back, since the next delta may complete a tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def parse_json_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """`{"name": ..., "arguments": {...}}` -> (name, arguments), or None if not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models double-encode; keep it if it is a JSON object, else not a call.
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def parse_xml_call(body: str, schemas: Schemas | None = None) -> tuple[str, dict[str, Any]] | None:
    """`<function=NAME><parameter=ARG>value</parameter>...</function>` -> (name, arguments).

    Anything but whitespace outside the parameter blocks means it is not a call (text the
    model wrote that only looks like one), so it is passed through rather than half-read.
    """
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m[1].strip()
    if not name:
        return None
    inner = m[2]
    props = _properties(schemas, name)
    args: dict[str, Any] = {}
    end = 0
    for p in _PARAMETER.finditer(inner):
        if inner[end : p.start()].strip():
            return None
        end = p.end()
        key = p[1].strip()
        args[key] = typed_value(_strip_newline(p[2]), props.get(key))
    if inner[end:].strip():
        return None
    return name, args


def parse_kv_call(body: str, schemas: Schemas | None = None) -> tuple[str, dict[str, Any]] | None:
    """`NAME<arg_key>K</arg_key><arg_value>V</arg_value>...` (GLM) -> (name, arguments);
    None when anything but whitespace lies between the pairs (not a call)."""
    m = _KV_NAME.match(body)
    if m is None:
        return None
    name, rest = m[1], body[m.end():]
    props = _properties(schemas, name)
    args: dict[str, Any] = {}
    end = 0
    for p in _KV_PAIR.finditer(rest):
        if rest[end : p.start()].strip():
            return None
        end = p.end()
        key = p[1].strip()
        args[key] = typed_value(p[2], props.get(key))
    if rest[end:].strip():
        return None
    if not args and schemas and name not in schemas:
        return None  # a bare word is a call only if it names a tool
    return name, args


TOOL_SEP = "<｜tool▁sep｜>"
_FENCED = re.compile(r"\s*([\w.\-]+)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*\Z", re.S)


def parse_sep_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """`NAME<｜tool▁sep｜>{...}` (DeepSeek-V3.1), or `function<｜tool▁sep｜>NAME` + a ```json
    fence (V3-0324 / R1) -> (name, arguments); None if the arguments are no JSON object."""
    left, _, right = body.partition(TOOL_SEP)
    name, text = left.strip(), right
    if name == "function" and (m := _FENCED.match(right)):
        name, text = m[1], m[2]
    if not re.fullmatch(r"[\w.\-]+", name):
        return None
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return (name, args) if isinstance(args, dict) else None


KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*")


def parse_kimi_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """`functions.NAME:IDX<|tool_call_argument_begin|>{...}` (Kimi-K2) -> (name, arguments):
    the name is the id less its `functions.` prefix and `:IDX` suffix (a dotted tool name
    stays whole); None if the arguments are no JSON object."""
    ident, _, text = body.partition(KIMI_ARGUMENTS)
    m = _KIMI_ID.fullmatch(ident)
    if m is None:
        return None
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return (m[1], args) if isinstance(args, dict) else None


# Bodies told apart by a separator token in them, before the shape-told styles.
_SEPARATED = ((TOOL_SEP, parse_sep_call), (KIMI_ARGUMENTS, parse_kimi_call))


def _strip_newline(text: str) -> str:
    # The template writes "<parameter=x>\n" + value + "\n</parameter>": one newline on each
    # side is framing, the rest (a multi-line value's own newlines) belongs to the value.
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _properties(schemas: Schemas | None, name: str) -> Mapping[str, Any]:
    schema = (schemas or {}).get(name) or {}
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def _types(prop: Any) -> list[str]:
    if not isinstance(prop, Mapping):
        return []
    kind = prop.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):  # e.g. Optional[int] from pydantic
        if isinstance(prop.get(key), list):
            return [t for sub in prop[key] for t in _types(sub)]
    if "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
        return ["string"]
    return []


def typed_value(text: str, prop: Any) -> Any:
    """A bare parameter value, typed by its JSON-schema property (string when unsure).

    Tried in the schema's order, so `["integer", "null"]` reads "null" as None and "3" as 3;
    a value that fits none of its types stays the text the model wrote, which the client
    can still see and reject, rather than a guess.
    """
    types = _types(prop)
    if not types:
        # No schema for it: JSON if it reads as a JSON value (what the template writes for
        # non-strings), else the text.
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if not isinstance(value, str) else text
    for kind in types:
        ok, value = _convert(text, kind)
        if ok:
            return value
    return text


def _convert(text: str, kind: str) -> tuple[bool, Any]:
    t = text.strip()
    if kind == "string":
        return True, text
    if kind == "null":
        return t.lower() in ("null", "none"), None
    if kind == "boolean":
        if t.lower() in ("true", "false"):
            return True, t.lower() == "true"
        return False, None
    if kind == "integer":
        try:
            return True, int(t)
        except ValueError:
            try:
                f = float(t)
            except ValueError:
                return False, None
            return (True, int(f)) if f.is_integer() else (False, None)
    if kind == "number":
        try:
            f = float(t)
        except ValueError:
            return False, None
        if f != f or f in (float("inf"), float("-inf")):
            return False, None  # not JSON
        return True, int(f) if f.is_integer() and re.fullmatch(r"-?\d+", t) else f
    if kind in ("object", "array"):
        try:
            value = json.loads(t)
        except ValueError:
            return False, None
        want = dict if kind == "object" else list
        return isinstance(value, want), value
    return False, None


def parse_call_body(body: str, schemas: Schemas | None = None) -> tuple[str, str] | None:
    """A `<tool_call>` body in either style -> (name, arguments as JSON text), or None."""
    start = body.lstrip()
    separated = next((parse for sep, parse in _SEPARATED if sep in body), None)
    if separated is not None:
        parsed = separated(body)
    elif start.startswith("{"):
        parsed = parse_json_call(body)
    elif start.startswith("<function="):
        parsed = parse_xml_call(body, schemas)
    else:
        parsed = parse_kv_call(body, schemas)
    if parsed is None:
        return None
    name, args = parsed
    return name, json.dumps(args, ensure_ascii=False)
