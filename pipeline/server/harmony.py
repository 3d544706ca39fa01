"""gpt-oss's harmony output -> content, reasoning and tool calls, streamed safely.

After the prompt's `<|start|>assistant` the model writes messages, each a header then a
body: `<|channel|>analysis<|message|>...<|end|>` (reasoning), `<|start|>assistant<|channel|>
final<|message|>...<|return|>` (the answer), and a tool call as `<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may also sit in
the role header: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`,
as the released template renders calls). Generation stops at `<|return|>` and `<|call|>`
(stop tokens: their text may never arrive), so the end of the output closes the message
being read. Commentary without a recipient (a preamble to the user) is content.

`HarmonyParser` has `OutputParser`'s interface (tool_calls.py hands it the output once it
sees `<|channel|>`): text that could start a marker is held until the next delta decides.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline.server.call_formats import Schemas, held_suffix

CHANNEL, MESSAGE, START, END, CALL, RETURN = (
    "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>")
_BODY_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=functions\.([\w.\-]+)")


class HarmonyParser:
    """Incremental harmony reader; `out` lists receive tool_calls' Content / Reasoning / Call."""

    def __init__(self, parts: Any, *, tools: bool, schemas: Schemas | None, header: str = "") -> None:
        self.parts = parts  # tool_calls: the Content / Reasoning / Call constructors and the adder
        self.tools, self.schemas = tools, schemas
        self._mode = "header"  # header (role + channel, up to <|message|>) | body | between
        self._header = header
        self._kind = "content"  # the body's: content | reasoning | call
        self._name = ""
        self._buf = ""

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "header":
            return (MESSAGE,)
        if self._mode == "body":
            return _BODY_ENDS
        return (START, CHANNEL)

    def feed(self, delta: str, out: list[Any]) -> None:
        self._buf += delta
        while True:
            hits = [(i, t) for t in self._tags() if (i := self._buf.find(t)) >= 0]
            if not hits:
                break
            index, tag = min(hits)
            before, self._buf = self._buf[:index], self._buf[index + len(tag):]
            self._close(before, tag, out)
        if self._mode == "body" and self._kind != "call":
            keep = held_suffix(self._buf, self._tags())
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            self._emit(ready, out)

    def finish(self, out: list[Any], cut: bool = False) -> None:
        """`cut`: the output ended at max_tokens (an unfinished call is dropped, not shown)."""
        rest, self._buf = self._buf, ""
        if self._mode == "body" and cut and self._kind == "call" and (not rest.strip() or _args(rest) is None):
            return
        if self._mode == "body":
            self._close(rest, RETURN, out)
        elif self._mode == "header" and (self._header + rest).strip():
            self.parts.content(self._header + rest, out)  # a header that never got a body

    def _close(self, before: str, tag: str, out: list[Any]) -> None:
        if self._mode == "header":  # <|message|>: the header is complete
            header = self._header + before
            self._header = ""
            m = _RECIPIENT.search(header)
            channel = header.split(CHANNEL)[-1].split()[0] if header.split(CHANNEL)[-1].split() else ""
            if m is not None and self.tools:
                self._kind, self._name = "call", m[1]
            else:
                self._kind = "reasoning" if channel == "analysis" else "content"
            self._mode = "body"
            return
        if self._mode == "body":
            if self._kind == "call":
                self._call(before, out)
            else:
                self._emit(before, out)
            self._mode = "between"
            return
        # between messages: <|start|> opens the role header, <|channel|> the channel
        self._mode, self._header = "header", (START if tag == START else CHANNEL)

    def _call(self, body: str, out: list[Any]) -> None:
        args = _args(body)
        if args is None:  # not a call after all: the text stays visible
            self.parts.content(body, out)
            return
        self.parts.call(self._name, json.dumps(args, ensure_ascii=False), out)

    def _emit(self, text: str, out: list[Any]) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            self.parts.reasoning(text, out)
        else:
            self.parts.content(text, out)


def _args(body: str) -> dict[str, Any] | None:
    """A call's arguments (a blank body: none), or None where the body is no JSON object."""
    try:
        args = json.loads(body) if body.strip() else {}
    except ValueError:
        return None
    return args if isinstance(args, dict) else None
