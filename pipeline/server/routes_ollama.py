"""Ollama's generation API (`/api/chat`, `/api/generate`), what Open WebUI, many editors
and the `ollama` client libraries speak; the model routes are routes_ollama_models.py.

A request is translated into an OpenAI chat (or, for a raw `/api/generate`, completion)
request and runs through the same checks, grammar and generation: `options` become
sampling knobs, `format: "json"` or a JSON schema becomes `response_format`, `think`
the template's enable_thinking switch, tools and tool results the template's. Replies
stream by default, as Ollama's do: one JSON object a line (NDJSON), the last with
`done: true`, the done reason and the counts and durations (nanoseconds). Errors are
`{"error": "..."}`, as Ollama's.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.sampling_params import SCALAR_KNOBS
from pipeline.events import Done, TextDelta
from pipeline.server import schema as s
from pipeline.server.api import Api
from pipeline.server.responses import ChatReply, Choice, Reply
from pipeline.server.routes_openai import plan_chat, plan_text
from pipeline.server.tool_calls import Call, Content, Reasoning
from pipeline.server.transport import json_response, ndjson_response, unless_disconnected


class OFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}


class OToolCall(msgspec.Struct, kw_only=True):
    function: OFunctionCall


class OMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # null as Ollama's decoder reads it: "" (a tool-call turn replayed)
    thinking: str | None = None  # earlier reasoning: not replayed into the prompt
    images: list[str] | None = None
    tool_calls: list[OToolCall] | None = None
    tool_name: str | None = None


class Options(msgspec.Struct, kw_only=True):
    """The `options` a request may set; the others (num_ctx, num_gpu, ...) describe
    Ollama's runner and are ignored here, as unknown request fields are."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1 (no limit) and -2 (fill the context): the server's cap
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class _Body(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: str | float | None = None  # the model stays loaded whatever it says


class ChatBody(_Body, kw_only=True):
    messages: list[OMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Body, kw_only=True):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    context: list[int] | None = None  # an earlier reply's `context`: the conversation's tokens
    template: str | None = None


# Ollama option -> the OpenAI request field it sets.
# Ollama's own name for a knob, where it differs.
OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}
_OPTION_FIELDS = {**{OLLAMA_NAMES.get(k, k): k for k in SCALAR_KNOBS},
                  "seed": "seed", "stop": "stop"}


def _within(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's num_predict is an upper bound, never refused: at most the server's limit."""
    if body.get("max_tokens") is not None:
        body["max_tokens"] = min(body["max_tokens"], api.settings.max_tokens_limit)
    return body


def _common(req: _Body) -> dict[str, Any]:
    """The OpenAI request fields an Ollama body's shared keys mean."""
    body: dict[str, Any] = {"model": req.model, "stream": req.stream}
    opts = req.options or Options()
    for option, field in _OPTION_FIELDS.items():
        if getattr(opts, option) is not None:
            body[field] = getattr(opts, option)
    if opts.num_predict is not None and opts.num_predict > 0:  # 0, -1, -2: no limit of its own
        body["max_tokens"] = opts.num_predict
    if req.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "format", "schema": req.format}}
    if req.think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.think is not False}
    return body


def _no_images(images: list[str] | None, param: str) -> None:
    if images:
        raise s.APIError(400, "images are not supported: this is a text-only model", param=param)


def chat_request(req: ChatBody) -> dict[str, Any]:
    """The OpenAI chat request body this Ollama chat request means."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        _no_images(m.images, f"messages[{i}].images")
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for j, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            msg["name"] = m.tool_name
        messages.append(msg)
    body = {**_common(req), "messages": messages}
    if req.tools:
        body["tools"] = req.tools
    return body


def generate_request(req: GenerateBody) -> dict[str, Any]:
    """The OpenAI body of a templated /api/generate: the prompt as the user's turn."""
    messages = [{"role": "system", "content": req.system}] if req.system else []
    return {**_common(req), "messages": [*messages, {"role": "user", "content": req.prompt}]}


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _line(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


def ollama_message(text: str, thinking: str, calls: list[Call]) -> dict[str, Any]:
    """An assistant message as Ollama writes it: tool arguments as an object, not text."""
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                             for c in calls]
    return msg


class OllamaReply:
    """One choice of a chat or text reply, as Ollama's objects: `key` is where text goes
    ("message" for /api/chat, "response" for /api/generate)."""

    def __init__(self, api: Api, reply: Reply, name: str, key: str) -> None:
        self.api = api
        self.reply = reply
        self.name = name
        self.key = key
        self.choice: Choice = reply.choices[0]
        self.t0 = time.perf_counter_ns()

    def obj(self, text: str = "", thinking: str = "", calls: list[Call] | None = None,
            done: Done | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.name, "created_at": _now()}
        if self.key == "message":
            out["message"] = ollama_message(text, thinking, calls or [])
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done is not None
        if done is not None:
            out.update(self.stats(done))
        return out

    def stats(self, done: Done) -> dict[str, Any]:
        st = done.stats
        total = time.perf_counter_ns() - self.t0
        prefill = int(st.ttft_s * 1e9)
        out: dict[str, Any] = {
            "done_reason": done.finish_reason, "total_duration": total, "load_duration": 0,
            "prompt_eval_count": st.prompt_tokens - st.cached_tokens,
            "prompt_eval_duration": prefill, "eval_count": st.completion_tokens,
            "eval_duration": max(total - prefill, 0)}
        if self.key == "response":  # what a later /api/generate may send back as `context`
            ids = list(done.token_ids)
            tokenizer = self.api.engine.tokenizer
            if done.finish_reason == "stop" and ids and tokenizer.decode(ids) != done.text:
                # A stop string cut the reply inside its last token: the context holds the
                # text the caller got, not what followed it.
                ids = tokenizer.encode(done.text, add_special_tokens=False) if done.text else []
            out["context"] = [*self.choice.tokens, *ids]
        return out

    async def parts(self) -> AsyncGenerator[tuple[str, str, list[Call], Done | None], None]:
        """(text, thinking, calls, done) pieces of the reply, as they come."""
        reply = self.reply
        if isinstance(reply, ChatReply):  # parsed into content, reasoning, calls
            async with aclosing(reply.parts(self.choice)) as parts:
                async for part in parts:
                    if isinstance(part, Done):
                        yield "", "", [], part
                    elif isinstance(part, Reasoning):
                        if not self.api.settings.hide_reasoning:
                            yield "", part.text, [], None
                    elif isinstance(part, Content):
                        yield part.text, "", [], None
                    else:
                        yield "", "", [part], None
            return
        async with aclosing(reply.run(self.choice)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    yield event.text, "", [], None
                else:
                    yield "", "", [], event

    async def complete(self) -> Response:
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[Call] = []
        done = None
        async with aclosing(self.parts()) as parts:
            async for text, thinking, called, end in parts:
                texts.append(text)
                thoughts.append(thinking)
                calls += called
                done = end or done
        assert done is not None
        text = "".join(texts)
        return json_response(self.obj(text.strip() if calls else text, "".join(thoughts),
                                      calls, done))

    async def stream(self) -> AsyncGenerator[bytes, None]:
        try:
            async with aclosing(self.parts()) as parts:
                async for text, thinking, calls, done in parts:
                    if text or thinking or calls:
                        yield _line(self.obj(text, thinking, calls))
                    elif done is not None:
                        yield _line(self.obj(done=done))
        except Exception as exc:
            if isinstance(exc, s.APIError) and not self.reply.admitted.is_set():
                raise  # still queued: the response answers with its own status
            yield _line(s.stream_failure(exc).ollama_body())


async def _respond(request: Request, reply: OllamaReply, stream: bool) -> Response:
    if stream:
        return ndjson_response(reply.stream(), ready=reply.reply.admitted)
    return await unless_disconnected(request, reply.complete)


def _loaded(api: Api, body: _Body, key: str) -> Response:
    """Ollama's answer to a request with nothing to generate: clients send one to load
    (or, with keep_alive 0, unload) a model. This one stays loaded either way."""
    name = api.check_model(body.model)
    reason = "unload" if body.keep_alive in (0, "0", "0s") else "load"
    text: dict[str, Any] = ({"message": {"role": "assistant", "content": ""}}
                            if key == "message" else {"response": ""})
    return json_response({"model": name, "created_at": _now(), **text, "done": True,
                          "done_reason": reason})


async def chat(api: Api, request: Request) -> Response:
    body: ChatBody = await api.decode(request, ChatBody)
    if not body.messages:
        return _loaded(api, body, "message")
    req = s.convert_request(_within(api, chat_request(body)), s.ChatRequest)
    plan = await plan_chat(api, req)
    return await _respond(request, OllamaReply(api, plan.reply(api, req), plan.name, "message"),
                          body.stream)


async def generate(api: Api, request: Request) -> Response:
    body: GenerateBody = await api.decode(request, GenerateBody)
    _no_images(body.images, "images")
    if not body.prompt and not body.context:
        return _loaded(api, body, "response")
    if body.template:
        raise s.APIError(400, "template (a Go template) is not supported: the container's chat "
                         "template is used; send raw: true for a prompt as it is",
                         param="template")
    if body.suffix:
        raise s.APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    reply: Reply
    if body.raw:
        text = s.convert_request(_within(api, {**_common(body), "prompt": body.prompt}), s.CompletionRequest)
        reply = await plan_text(api, text)
        name = reply.model
    else:
        req = s.convert_request(_within(api, generate_request(body)), s.ChatRequest)
        plan = await plan_chat(api, req)
        reply, name = plan.reply(api, req), plan.name
    if body.context:
        # The earlier conversation's tokens go first, as Ollama's runner does.
        tokens = [*body.context, *reply.choices[0].tokens]
        api.check_prompt(tokens, reply.choices[0].params, "context")
        reply.choices = [msgspec.structs.replace(c, tokens=tokens) for c in reply.choices]
    return await _respond(request, OllamaReply(api, reply, name, "response"), body.stream)
