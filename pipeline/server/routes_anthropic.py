"""Anthropic's Messages API (`POST /v1/messages`), what coding agents such as Claude Code speak.

The request is translated into an OpenAI chat request (system prompt, text, tool_use and
tool_result blocks, tools, tool_choice) and runs through the same checks and generation;
the reply is written as Anthropic content blocks, or as its SSE event sequence
(message_start, content_block_start/delta/stop, message_delta, message_stop).
Errors keep Anthropic's shape `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.events import Done
from pipeline.server import schema as s
from pipeline.server.api import Api
from pipeline.server.responses import ChatReply
from pipeline.server.routes_openai import chat_prompt, plan_chat
from pipeline.server.tool_calls import Call, Content, Reasoning
from pipeline.server.transport import json_response, sse_response, unless_disconnected


class Block(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class AMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ATool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class AToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    # The template's enable_thinking switch; the budget is not enforced (max_tokens is).
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None  # required by /messages, not by /messages/count_tokens
    messages: list[AMessage]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: Thinking | None = None


def _text(content: str | list[Block] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for i, b in enumerate(content):
        if b.type != "text" or b.text is None:
            raise s.APIError(400, f"content block type {b.type!r} is not supported here",
                             param=f"{param}[{i}].type")
        out.append(b.text)
    return "".join(out)


def to_chat(req: MessagesRequest) -> dict[str, Any]:
    """The OpenAI chat request body this Anthropic request means."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        texts, calls = [], []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append({"id": b.id or f"toolu_{j}", "type": "function", "function": {
                    "name": b.name or "", "arguments": json.dumps(b.input or {})}})
            elif b.type == "tool_result" and m.role == "user":
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": _text(b.content, f"{where}.content")})
            elif b.type in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not replayed into the prompt
            else:
                raise s.APIError(400, f"content block type {b.type!r} is not supported in a "
                                 f"{m.role} message", param=f"{where}.type")
        if texts or calls or not blocks:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    body: dict[str, Any] = {"model": req.model, "messages": messages,
                            "max_tokens": req.max_tokens, "stream": req.stream}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    # Anthropic's thinking is opt-in: a request without `thinking` gets text first, as
    # Claude-style clients expect, even from a template that thinks by default.
    thinking = req.thinking.type if req.thinking is not None else "disabled"
    body["chat_template_kwargs"] = {"enable_thinking": thinking != "disabled"}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": t.input_schema or {"type": "object"}}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name or ""}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body




def _usage(done: Done) -> dict[str, int]:
    st = done.stats
    return {"input_tokens": st.prompt_tokens - st.cached_tokens, "output_tokens":
            st.completion_tokens, "cache_read_input_tokens": st.cached_tokens,
            "cache_creation_input_tokens": 0}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + msgspec.json.encode({"type": kind, **data}) + b"\n\n"


class MessagesReply:
    def __init__(self, chat: ChatReply, hide_reasoning: bool) -> None:
        self.chat = chat
        self.hide_reasoning = hide_reasoning
        self.id = "msg_" + secrets.token_hex(12)

    def stop_sequence(self, done: Done) -> str | None:
        """The stop sequence that ended the reply (the one found first in the whole
        generated text; the reply itself is cut before it), or None."""
        stops = self.chat.choices[0].params.stop
        tokenizer = self.chat.engine.tokenizer
        if done.finish_reason != "stop" or not stops or not done.token_ids \
                or done.token_ids[-1] in tokenizer.eos_token_ids:
            return None
        full = tokenizer.decode(list(done.token_ids))
        found = [(full.find(s), s) for s in stops if s in full]
        return min(found)[1] if found else None

    def stop_reason(self, done: Done, called: bool) -> str:
        if done.finish_reason == "length":
            return "max_tokens"
        if self.stop_sequence(done) is not None:
            return "stop_sequence"
        return "tool_use" if called else "end_turn"

    def message(self, content: list[dict[str, Any]], stop: str | None,
                usage: dict[str, int], done: Done | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.chat.model,
                "content": content, "stop_reason": stop,
                "stop_sequence": self.stop_sequence(done) if done else None, "usage": usage}

    async def complete(self) -> Response:
        content: list[dict[str, Any]] = []
        done = None
        async with aclosing(self.chat.parts(self.chat.choices[0])) as parts:
            async for part in parts:
                if isinstance(part, Done):
                    done = part
                elif isinstance(part, Reasoning):
                    if not self.hide_reasoning:
                        if content and content[-1]["type"] == "thinking":
                            content[-1]["thinking"] += part.text
                        else:
                            content.append({"type": "thinking", "thinking": part.text,
                                            "signature": ""})
                elif isinstance(part, Content):
                    if content and content[-1]["type"] == "text":
                        content[-1]["text"] += part.text
                    else:
                        content.append({"type": "text", "text": part.text})
                else:
                    content.append({"type": "tool_use", "id": "toolu_" + part.id[5:],
                                    "name": part.name, "input": json.loads(part.arguments)})
        assert done is not None
        called = any(c["type"] == "tool_use" for c in content)
        if called:  # text around calls is whitespace the template put there
            content = [c for c in content if c["type"] != "text" or c["text"].strip()]
        return json_response(self.message(content, self.stop_reason(done, called), _usage(done),
                                          done))

    async def stream(self) -> AsyncGenerator[bytes, None]:
        yield _event("message_start", {"message": self.message(
            [], None, {"input_tokens": len(self.chat.choices[0].tokens), "output_tokens": 0})})
        index, open_kind, called = -1, None, False
        try:
            async with aclosing(self.chat.parts(self.chat.choices[0])) as parts:
                async for part in parts:
                    if isinstance(part, Done):
                        if open_kind is not None:
                            yield _event("content_block_stop", {"index": index})
                        yield _event("message_delta", {
                            "delta": {"stop_reason": self.stop_reason(part, called),
                                      "stop_sequence": self.stop_sequence(part)},
                            "usage": _usage(part)})
                        yield _event("message_stop", {})
                        return
                    if isinstance(part, Reasoning) and self.hide_reasoning:
                        continue
                    kind = ("thinking" if isinstance(part, Reasoning) else
                            "text" if isinstance(part, Content) else "tool_use")
                    if kind != open_kind or kind == "tool_use":
                        if open_kind is not None:
                            yield _event("content_block_stop", {"index": index})
                        index, open_kind = index + 1, kind
                        yield _event("content_block_start", {"index": index,
                                                             "content_block": _start(part)})
                    if isinstance(part, Call):
                        called = True
                        delta = {"type": "input_json_delta", "partial_json": part.arguments}
                    elif isinstance(part, Reasoning):
                        delta = {"type": "thinking_delta", "thinking": part.text}
                    else:
                        delta = {"type": "text_delta", "text": part.text}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
        except Exception as exc:
            yield _event("error", {"error": s.stream_failure(exc).anthropic_body()["error"]})


def _start(part: Content | Reasoning | Call) -> dict[str, Any]:
    if isinstance(part, Call):
        return {"type": "tool_use", "id": "toolu_" + part.id[5:], "name": part.name, "input": {}}
    if isinstance(part, Reasoning):
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


async def _chat_reply(api: Api, request: Request) -> tuple[MessagesRequest, ChatReply]:
    anthropic: MessagesRequest = await api.decode(request, MessagesRequest)
    req = s.convert_request(to_chat(anthropic), s.ChatRequest)
    plan = await plan_chat(api, req)
    chat = plan.reply(api, req)
    return anthropic, chat


async def messages(api: Api, request: Request) -> Response:
    anthropic, chat = await _chat_reply(api, request)
    if anthropic.max_tokens is None:
        raise s.APIError(400, "max_tokens is required", param="max_tokens")
    # Without `thinking` (or with it disabled) no thinking block is sent: a template that
    # thinks whatever enable_thinking says (Qwen3-Next Thinking) still thinks, unseen.
    asked = anthropic.thinking is not None and anthropic.thinking.type != "disabled"
    reply = MessagesReply(chat, api.settings.hide_reasoning or not asked)
    if anthropic.stream:
        return sse_response(reply.stream())
    return await unless_disconnected(request, reply.complete)


async def count_tokens(api: Api, request: Request) -> Response:
    anthropic: MessagesRequest = await api.decode(request, MessagesRequest)
    req = s.convert_request(to_chat(anthropic), s.ChatRequest)
    api.check_model(req.model)
    return json_response({"input_tokens": len((await chat_prompt(api, req))[1])})
