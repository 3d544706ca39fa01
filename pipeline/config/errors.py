"""Config errors that name what is wrong: the file, the dotted key, its line, a suggestion.

`Locator` finds a key's line by scanning the TOML text (tomllib keeps no positions) and
turns msgspec's validation messages into `file: key: problem (line N)`; `unknown_keys`
and `one_of` add difflib's "did you mean" for misspelt keys and values.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

import msgspec
import msgspec.inspect as mi

from actors.bounds import range_at, type_at
from pipeline.config.toml import dumps_value


class ConfigError(ValueError):
    """A config that cannot be used; the message names file, key and line."""


def one_of(field: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        hint = difflib.get_close_matches(value, allowed, n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{field} must be one of {choices}, got {value!r}{extra}")


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def unknown_keys(
    raw: Any, tp: type[msgspec.Struct], prefix: tuple[str, ...]
) -> list[tuple[tuple[str, ...], str | None]]:
    if not isinstance(raw, dict):
        return []  # the wrong-type error comes from msgspec, with its own message
    fields = {f.name: f for f in msgspec.structs.fields(tp)}
    out: list[tuple[tuple[str, ...], str | None]] = []
    for key, value in raw.items():
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            out.append(((*prefix, key), hint[0] if hint else None))
        elif (sub := _struct_type(fields[key].type)) is not None:
            out.extend(unknown_keys(value, sub, (*prefix, key)))
    return out


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(
    r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*="""
)
_MSGSPEC_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _split_key(key: str) -> tuple[str, ...]:
    return tuple(p.strip().strip("\"'") for p in key.split("."))


class Locator:
    """Finds the line of a dotted key by a simple scan of the TOML text."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.overridden: dict[tuple[str, ...], str] = {}
        self.lines: dict[tuple[str, ...], int] = {}
        section: tuple[str, ...] = ()
        for n, line in enumerate(text.splitlines(), start=1):
            if h := _HEADER.match(line):
                section = _split_key(h.group(1))
                self.lines.setdefault(section, n)
            elif k := _KEY.match(line):
                self.lines.setdefault((*section, *_split_key(k.group(1))), n)

    def at(self, key: tuple[str, ...]) -> str:
        """' (line N)', " (override 'k=v')" or '' for the key or its nearest enclosing one."""
        for i in range(len(key), 0, -1):
            if key[:i] in self.overridden:
                return f" (override {self.overridden[key[:i]]!r})"
            if key[:i] in self.lines:
                return f" (line {self.lines[key[:i]]})"
        return ""

    def unknown(self, key: tuple[str, ...], hint: str | None) -> str:
        extra = f"; did you mean {hint!r}?" if hint else ""
        return f"{self.source}: unknown key {'.'.join(key)!r}{self.at(key)}{extra}"

    def validation(self, message: str, raw: dict[str, Any], root: type | None = None) -> str:
        """msgspec's message as `file: key: problem (line N)`; with `root` (the config's
        type) a value out of range is told the whole range its annotation declares."""
        m = _MSGSPEC_AT.match(message)
        assert m is not None  # the pattern matches any string
        msg, path = m.group("msg"), m.group("path") or ""
        key = tuple(p for p in re.split(r"\.|\[(\d+)\]", path) if p)
        if missing := re.match(r"Object missing required field `(\w+)`", msg):
            full = (*key, missing.group(1))
            return f"{self.source}: missing required key {'.'.join(full)!r}{self.at(key)}"
        if expected := re.match(r"Expected `([^`]*)`(.*?)(?:, got `(\w+)`)?$", msg):
            tp = " | ".join(_toml_type(t) for t in expected.group(1).split(" | ") if t != "null")
            want = f"expected {tp}{expected.group(2)}"
            value = _lookup(raw, key)
            # With a type name this is a wrong type; without, a range constraint failed.
            got = _toml_type(expected.group(3)) + " " if expected.group(3) else ""
            if not got and root is not None and (rng := range_at(root, key)) is not None:
                want = f"expected {tp} {rng}"
            want += f", got {got}{_show(value)}".rstrip()
            return f"{self.source}: {_dotted(key)}: {want}{self.at(key)}"
        if unknown := re.match(r"Object contains unknown field `([^`]*)`", msg):
            full = (*key, unknown.group(1))
            return f"{self.source}: unknown key {_dotted(full)!r}{self.at(full)}"
        if enum := re.match(r"Invalid enum value (.*)", msg):
            allowed = _choices(root, key) if root is not None else ""
            return (f"{self.source}: {_dotted(key)}: invalid value {enum.group(1)}{allowed}"
                    f"{self.at(key)}")
        # A ValueError from a section's __post_init__: it starts with the field's name.
        first = msg.split(" ", 1)[0]
        if key and isinstance(_lookup(raw, key), dict) and first.isidentifier():
            return f"{self.source}: {_dotted(key)}.{msg}{self.at((*key, first))}"
        return f"{self.source}: {_dotted(key) or 'config'}: {msg}{self.at(key)}"


def _choices(root: type, key: tuple[str, ...]) -> str:
    """", expected one of ..." for a key whose annotation lists its values (a Literal)."""
    t = type_at(root, key)
    if isinstance(t, mi.UnionType):  # an optional Literal, or a number or a Literal
        literals = [u for u in t.types if isinstance(u, mi.LiteralType)]
        numbers = [u for u in t.types if isinstance(u, mi.IntType | mi.FloatType)]
        if len(literals) == 1:
            words = ", ".join(repr(v) for v in literals[0].values)
            return f", expected {'a number or ' if numbers else ''}one of {words}"
        return ""
    if isinstance(t, mi.LiteralType):
        return ", expected one of " + ", ".join(repr(v) for v in t.values)
    return ""


def _dotted(key: tuple[str, ...]) -> str:
    out = ""
    for p in key:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def _lookup(raw: Any, key: tuple[str, ...]) -> Any:
    node = raw
    for p in key:
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return None
    return node


def _toml_type(name: str) -> str:
    return {"object": "table", "array": "array", "null": "nothing"}.get(name, name)


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        text = dumps_value(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return dumps_value(value) if value is not None else ""
