"""Model text -> OpenAI message parts: content, reasoning and tool calls, streamed safely.

Qwen models write tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen3-Next) or `<tool_call><function=NAME><parameter=ARG>value</parameter></function>
</tool_call>` (Qwen3.5/3.6; values typed from the tools' JSON schemas, see `call_formats`),
DeepSeek-V3.x as `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` inside a
`<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` section, Kimi-K2 as
`<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>` inside
`<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>`,
and thinking as `<think>...</think>` (thinking templates open the `<think>` in the prompt,
so the output starts inside it: the caller says so with `in_reasoning`). gpt-oss writes
harmony channels instead (`<|channel|>analysis<|message|>...`): from its first `<|channel|>`
or `<|start|>` the output goes to `harmony.HarmonyParser`, which makes the same parts.
`OutputParser.feed(delta)` turns raw text deltas into `Content`, `Reasoning` and `Call`
parts as soon as they are certain: text that could be the start of a tag is held back
until the next delta decides it, so a client never sees half a tag, and a tool call is
emitted whole once its closing tag arrives. A block that parses in neither style is
passed through as content (the model wrote something call-shaped that is not a call;
hiding it would lose text).

The non-streaming path feeds the whole text through the same parser, so both paths
agree by construction.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from pipeline.server.call_formats import Schemas, held_suffix, parse_call_body
from pipeline.server.harmony import CHANNEL, START, HarmonyParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# DeepSeek-V3.x: each call in <｜tool▁call▁begin｜>...<｜tool▁call▁end｜>, the calls framed by a
# section whose markers carry nothing (dropped).
DS_CALL_OPEN, DS_CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
# Kimi-K2: the same shape in its own tokens.
KIMI_CALL_OPEN, KIMI_CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
SECTIONS = (*DS_SECTION, *KIMI_SECTION)
# opening tag -> its closing tag
CALLS = {CALL_OPEN: CALL_CLOSE, DS_CALL_OPEN: DS_CALL_CLOSE, KIMI_CALL_OPEN: KIMI_CALL_CLOSE}
HARMONY = (CHANNEL, START)  # gpt-oss's message markers: the rest is harmony


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)


Part = Content | Reasoning | Call


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_call(body: str, schemas: Schemas | None = None) -> tuple[str, str] | None:
    """A `<tool_call>` body, JSON or XML style -> (name, arguments JSON), or None if not a call."""
    return parse_call_body(body, schemas)


class OutputParser:
    """Incremental splitter of model output into content, reasoning and tool calls.

    tools: parse `<tool_call>` blocks (False when the request has no tools: the text
    is then plain content). in_reasoning: the prompt already opened `<think>`. schemas:
    tool name -> its `parameters` schema, which types XML-style argument values.
    """

    def __init__(self, *, tools: bool = True, in_reasoning: bool = False,
                 schemas: Schemas | None = None) -> None:
        self.tools = tools
        self.schemas = schemas
        self._mode = "reasoning" if in_reasoning else "content"
        self._open = CALL_OPEN  # the tag that opened the call being read
        self._buf = ""
        self._pending_ws = ""  # whitespace between calls: content only if text follows
        self.calls: list[Call] = []
        self._harmony: HarmonyParser | None = None

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "reasoning":
            return (THINK_CLOSE,)
        if self._mode == "call":
            return (CALLS[self._open],)
        return (THINK_OPEN, *CALLS, *SECTIONS, *HARMONY) if self.tools else (THINK_OPEN, *HARMONY)

    def feed(self, delta: str) -> list[Part]:
        out: list[Part] = []
        if self._harmony is not None:
            self._harmony.feed(delta, out)
            return out
        self._buf += delta
        while self._harmony is None:
            tags = self._tags()
            hits = [(i, t) for t in tags if (i := self._buf.find(t)) >= 0]
            if not hits:
                break
            index, tag = min(hits)
            before, self._buf = self._buf[:index], self._buf[index + len(tag):]
            self._close_segment(before, tag, out)
        if self._harmony is not None:
            rest, self._buf = self._buf, ""
            self._harmony.feed(rest, out)
        elif self._mode != "call":
            keep = held_suffix(self._buf, self._tags())
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            self._emit(ready, out)
        return out

    def finish(self, cut: bool = False) -> list[Part]:
        """End of output: release what was held. An unclosed call is passed through as
        text, unless the output was `cut` (max_tokens): then it is dropped, as a call the
        length limit cut off (its markup shown as the reply's text is what an agent would
        then read back or show)."""
        out: list[Part] = []
        if self._harmony is not None:
            self._harmony.finish(out, cut)
            return out
        rest, self._buf = self._buf, ""
        if self._mode == "call":
            parsed = parse_call(rest, self.schemas) if self.tools else None
            if parsed is not None:
                self._add_call(*parsed, out)
            elif not cut:
                self._mode = "content"
                self._emit(self._open + rest, out)
        else:
            self._emit(rest, out)
        if self._pending_ws and not self.calls:
            self._content(self._pending_ws, out, flush=True)
        self._pending_ws = ""
        return out

    def _close_segment(self, before: str, tag: str, out: list[Part]) -> None:
        if self._mode == "call":  # `tag` closes the call
            parsed = parse_call(before, self.schemas)
            self._mode = "content"
            if parsed is None:
                self._emit(self._open + before + tag, out)
            else:
                self._add_call(*parsed, out)
            return
        self._emit(before, out)
        if tag == THINK_OPEN:
            self._mode = "reasoning"
        elif tag == THINK_CLOSE:
            self._mode = "content"
        elif tag in CALLS:
            self._mode, self._open = "call", tag
        elif tag in HARMONY:
            self._harmony = HarmonyParser(self, tools=self.tools, schemas=self.schemas, header=tag)

    # What the harmony parser hands back (its parts, in this parser's terms).
    def content(self, text: str, out: list[Part]) -> None:
        self._content(text, out)

    def reasoning(self, text: str, out: list[Part]) -> None:
        out.append(Reasoning(text))

    def call(self, name: str, arguments: str, out: list[Part]) -> None:
        self._add_call(name, arguments, out)

    def _add_call(self, name: str, arguments: str, out: list[Part]) -> None:
        self._pending_ws = ""
        call = Call(len(self.calls), new_call_id(), name, arguments)
        self.calls.append(call)
        out.append(call)

    def _emit(self, text: str, out: list[Part]) -> None:
        if not text:
            return
        if self._mode == "reasoning":
            out.append(Reasoning(text))
        else:
            self._content(text, out)

    def _content(self, text: str, out: list[Part], flush: bool = False) -> None:
        if flush:
            self._append(text, out)
            return
        # Trailing whitespace waits to see what follows: dropped before a tool call (the
        # "\n" between calls), sent with the next text otherwise. Holding it however the
        # text was cut keeps streamed and one-shot output identical.
        text = self._pending_ws + text
        kept = text.rstrip()
        self._pending_ws = text[len(kept):]
        self._append(kept, out)

    @staticmethod
    def _append(text: str, out: list[Part]) -> None:
        if not text:
            return
        if out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + text)
        else:
            out.append(Content(text))


@dataclass
class ParsedOutput:
    content: str | None
    reasoning: str | None
    calls: list[Call]


def parse_output(text: str, *, tools: bool = True, in_reasoning: bool = False,
                 schemas: Schemas | None = None) -> ParsedOutput:
    """The whole output at once (non-streaming), through the streaming parser."""
    parser = OutputParser(tools=tools, in_reasoning=in_reasoning, schemas=schemas)
    parts = parser.feed(text) + parser.finish()
    content = "".join(p.text for p in parts if isinstance(p, Content))
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    calls = [p for p in parts if isinstance(p, Call)]
    if calls:
        content = content.strip()
    return ParsedOutput(content or (None if calls else ""), reasoning or None, calls)
