"""OpenAI's Responses API (`POST /v1/responses`), stateless.

The request (`input` as text or items: messages, function calls and their outputs;
`instructions`; function tools; `text.format` for structured output) is translated into
a chat request and runs through the same checks and generation. The reply is a
`response` object with output items (reasoning, message, function_call), or its SSE
event sequence (response.created ... response.completed, no `[DONE]`). Nothing is
stored, so `previous_response_id` is refused rather than silently dropped.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.events import Done
from pipeline.server import schema as s
from pipeline.server.api import Api
from pipeline.server.responses import ChatReply
from pipeline.server.routes_openai import plan_chat
from pipeline.server.tool_calls import Call, Content, Reasoning
from pipeline.server.transport import json_response, sse_response, unless_disconnected


class Item(msgspec.Struct, kw_only=True):
    type: str = "message"
    role: str | None = None
    content: str | list[s.ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[s.ContentPart] | None = None  # a tool's result: text, or its parts


class RTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[RTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    previous_response_id: str | None = None


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    if req.previous_response_id:
        raise s.APIError(400, "previous_response_id is not supported: this server stores no "
                         "responses; send the whole conversation in `input`",
                         param="previous_response_id")
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise s.APIError(400, f"input item role {item.role!r} is not supported",
                                 param=f"input[{i}].role")
            content = item.content
            if isinstance(content, list):
                content = [msgspec.to_builtins(p) for p in content]
            messages.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            call = {"id": item.call_id or f"call_{i}", "type": "function",
                    "function": {"name": item.name or "", "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant":  # one turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            output = item.output
            if isinstance(output, list):
                output = [msgspec.to_builtins(p) for p in output]
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output or ""})
        elif item.type == "reasoning":
            continue
        else:
            raise s.APIError(400, f"input item type {item.type!r} is not supported",
                             param=f"input[{i}].type")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for key, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[key] = value
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or not t.name:
            raise s.APIError(400, f"tool type {t.type!r} is not supported (only named "
                             "functions)", param=f"tools[{i}].type")
        tools.append({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}})
    if tools:
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type, **({"json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
            if fmt.type == "json_schema" else {})}
    return body


def _usage(done: Done | None) -> dict[str, Any] | None:
    if done is None:
        return None
    st = done.stats
    return {"input_tokens": st.prompt_tokens, "output_tokens": st.completion_tokens,
            "total_tokens": st.prompt_tokens + st.completion_tokens,
            "input_tokens_details": {"cached_tokens": st.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponsesReply:
    def __init__(self, chat: ChatReply, req: ResponsesRequest, hide_reasoning: bool) -> None:
        self.chat = chat
        self.req = req
        self.hide_reasoning = hide_reasoning
        self.id = "resp_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.seq = 0

    def response(self, output: list[dict[str, Any]], done: Done | None) -> dict[str, Any]:
        length = done is not None and done.finish_reason == "length"
        status = "in_progress" if done is None else "incomplete" if length else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.chat.model, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                "error": None, "instructions": self.req.instructions,
                "max_output_tokens": self.req.max_output_tokens,
                "parallel_tool_calls": self.req.parallel_tool_calls is not False,
                "tool_choice": self.req.tool_choice or "auto",
                "tools": [msgspec.to_builtins(t) for t in self.req.tools or []],
                "temperature": self.req.temperature, "top_p": self.req.top_p,
                "usage": _usage(done), "metadata": {}}

    def item(self, part: Content | Reasoning | Call, text: str = "") -> dict[str, Any]:
        if isinstance(part, Call):
            return {"type": "function_call", "id": "fc_" + part.id[5:], "call_id": part.id,
                    "name": part.name, "arguments": part.arguments, "status": "completed"}
        if isinstance(part, Reasoning):
            return {"type": "reasoning", "id": "rs_" + secrets.token_hex(8), "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}]}
        return {"type": "message", "id": "msg_" + secrets.token_hex(8), "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    async def collect(self) -> tuple[list[dict[str, Any]], Done]:
        output: list[dict[str, Any]] = []
        done = None
        async with aclosing(self.chat.parts(self.chat.choices[0])) as parts:
            async for part in parts:
                if isinstance(part, Done):
                    done = part
                elif isinstance(part, Call):
                    output.append(self.item(part))
                elif isinstance(part, Reasoning) and self.hide_reasoning:
                    continue
                else:
                    kind = "reasoning" if isinstance(part, Reasoning) else "message"
                    if output and output[-1]["type"] == kind:
                        output[-1]["content"][0]["text"] += part.text
                    else:
                        output.append(self.item(part, part.text))
        assert done is not None
        if any(o["type"] == "function_call" for o in output):
            output = [o for o in output if o["type"] != "message"
                      or o["content"][0]["text"].strip()]
        return output, done

    async def complete(self) -> Response:
        output, done = await self.collect()
        return json_response(self.response(output, done))

    def event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        body = {"type": kind, "sequence_number": self.seq, **data}
        return f"event: {kind}\ndata: ".encode() + msgspec.json.encode(body) + b"\n\n"

    async def stream(self) -> AsyncGenerator[bytes, None]:
        yield self.event("response.created", response=self.response([], None))
        yield self.event("response.in_progress", response=self.response([], None))
        output: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None

        def close() -> list[bytes]:
            if current is None:
                return []
            i = len(output) - 1
            if current["type"] == "message":
                part = current["content"][0]
                return [self.event("response.output_text.done", item_id=current["id"],
                                   output_index=i, content_index=0, text=part["text"]),
                        self.event("response.content_part.done", item_id=current["id"],
                                   output_index=i, content_index=0, part=part),
                        self.event("response.output_item.done", output_index=i, item=current)]
            return [self.event("response.output_item.done", output_index=i, item=current)]

        try:
            async with aclosing(self.chat.parts(self.chat.choices[0])) as parts:
                async for part in parts:
                    if isinstance(part, Done):
                        for chunk in close():
                            yield chunk
                        yield self.event("response.completed", response=self.response(output, part))
                        return
                    if isinstance(part, Reasoning) and self.hide_reasoning:
                        continue
                    kind = ("function_call" if isinstance(part, Call) else
                            "reasoning" if isinstance(part, Reasoning) else "message")
                    if current is None or current["type"] != kind or kind == "function_call":
                        for chunk in close():
                            yield chunk
                        current = self.item(part)
                        output.append(current)
                        i = len(output) - 1
                        # Announced empty and in progress: the text comes in its part's deltas
                        # (a content part here too made a client's snapshot hold two).
                        empty = ({**current, "arguments": "", "status": "in_progress"} if kind == "function_call"
                                 else {**current, "content": [], "status": "in_progress"} if kind == "message"
                                 else current)
                        yield self.event("response.output_item.added", output_index=i, item=empty)
                        if kind == "message":
                            yield self.event("response.content_part.added", item_id=current["id"],
                                             output_index=i, content_index=0,
                                             part={"type": "output_text", "text": "",
                                                   "annotations": []})
                    i = len(output) - 1
                    if isinstance(part, Call):
                        yield self.event("response.function_call_arguments.delta",
                                         item_id=current["id"], output_index=i,
                                         delta=part.arguments)
                        yield self.event("response.function_call_arguments.done",
                                         item_id=current["id"], output_index=i,
                                         arguments=part.arguments)
                    elif isinstance(part, Reasoning):
                        current["content"][0]["text"] += part.text
                        yield self.event("response.reasoning_text.delta", item_id=current["id"],
                                         output_index=i, content_index=0, delta=part.text)
                    else:
                        current["content"][0]["text"] += part.text
                        yield self.event("response.output_text.delta", item_id=current["id"],
                                         output_index=i, content_index=0, delta=part.text)
        except Exception as exc:
            err = s.stream_failure(exc)
            yield self.event("error", code=err.code or err.type, message=err.message,
                             param=err.param)


async def create(api: Api, request: Request) -> Response:
    rreq: ResponsesRequest = await api.decode(request, ResponsesRequest)
    req = s.convert_request(to_chat(rreq), s.ChatRequest)
    plan = await plan_chat(api, req)
    chat = plan.reply(api, req)
    reply = ResponsesReply(chat, rreq, api.settings.hide_reasoning)
    if rreq.stream:
        return sse_response(reply.stream())
    return await unless_disconnected(request, reply.complete)

