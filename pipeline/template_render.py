"""Chat templates rendered as transformers renders them, without importing transformers.

The container's template (chat_template.jinja, or tokenizer_config.json's
`chat_template`) is Hub code: it runs in jinja2's immutable sandbox with the environment
transformers gives it (trim_blocks, lstrip_blocks, loopcontrols; `tojson` that keeps
non-ASCII and takes indent/separators; `raise_exception`, `strftime_now`; `namespace`
that refuses dunder names), so a template renders the same text here as under
`AutoTokenizer.apply_chat_template`. Importing transformers for this costs ~42 MiB
resident (measured) and the old tokenizer path ~210 MiB: see docs/memory.md.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

# Names a message's reasoning arrives under; templates read the first (transformers
# fills it from the others, and `thinking` for templates that read that).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters: tool schemas would differ.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compiled(template: str) -> Any:
    """The template compiled once per text (a server renders every request with it)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Namespace(jinja2.utils.Namespace):
        # No underscore names: a template must not reach CPython internals through one.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes: {name!r}")

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (its assistant-token
        mask's markers): the body, rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = Namespace
    return env.from_string(template)


def plain(value: Any) -> Any:
    """JSON-typed copies of what the template sees: objects with methods stay out of the
    sandbox, and the caller's messages are never edited."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return f"<{type(value).__name__}>"  # templates test media keys, never read values


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], /, *,
           tools: Sequence[Mapping[str, Any]] | None = None,
           documents: Sequence[Mapping[str, Any]] | None = None,
           add_generation_prompt: bool = False, **variables: Any) -> str:
    """The prompt text; `variables` are the special tokens and chat_template_kwargs."""
    chat = plain(list(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
    # transformers drops a message's keys whose value is None before rendering: a template
    # tests `'tool_calls' in message`, and iterates what it finds.
    chat = [{k: v for k, v in message.items() if v is not None} for message in chat]
    # One mapping, not keywords: a variable may be named `self` (jinja2's render takes it).
    return compiled(template).render({
        **plain(variables), "messages": _alias_reasoning(chat),
        "tools": plain(list(tools)) if tools is not None else None,
        "documents": plain(list(documents)) if documents is not None else None,
        "add_generation_prompt": add_generation_prompt})
