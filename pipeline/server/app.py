"""The OpenAI-compatible HTTP face: a starlette app over one open engine, served by hypercorn/trio.

    async with open_engine(config) as engine:
        await serve_engine(engine, "127.0.0.1", 8000, api_key="...")

Every request is checked (auth, body size, JSON, fields, model, prompt length, queue)
before a response starts, so refusals are proper OpenAI error bodies with the right
status. Generations run in the request's task: a client that goes away cancels its
task, and `aclosing` hands the engine's generator back at once (the engine drains
its reads and unpins the pool). The engine serves one generation at a time; the
others wait on its FIFO lock, up to `max_queue` of them.

This module checks requests and routes them; pipeline.server_responses builds the replies
(one JSON body, or SSE chunks).
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors.sampling_params import SamplingParams
from pipeline.chat_template import TemplateKwargsError, template_kwargs
from pipeline.engine import Engine
from pipeline.generation import Generation, PromptTooLong
from pipeline.generation_config import default_params
from pipeline.server import schema as s
from pipeline.server.drain import Drain
from pipeline.server.metrics import Metrics
from pipeline.server.responses import ChatReply, TextReply, json_response, respond
from qpack.checked_files import unreadable_files

log = structlog.get_logger("moestream.server")

KNOWN_PATHS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True):
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 8192
    hide_reasoning: bool = False
    aliases: tuple[str, ...] = ()  # more names the model answers to (e.g. the CLI's path)
    defaults: SamplingParams = SamplingParams()


def _error(exc: s.APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return json_response(exc.body(), exc.status, headers)


class _StatusCounter:
    """ASGI middleware: counts responses by route and status for /metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        label = next((p for p in KNOWN_PATHS if path == p or path.startswith(p + "/")), "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.record_request(label, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


class Api:
    def __init__(self, engine: Engine, settings: ServerSettings, metrics: Metrics,
                 drain: Drain | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.drain = drain or Drain()
        self.created = int(time.time())

    # --- checks ------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise s.APIError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                             code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise s.APIError(400, f"Content-Length {length!r} is not a byte count")
            if int(length) > limit:
                raise s.APIError(413, f"request body of {length} bytes is over the limit of "
                                 f"{limit} bytes", code="request_too_large")
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise s.APIError(413, f"request body is over the limit of {limit} bytes",
                                 code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def model_names(self) -> set[str]:
        root = str(self.engine.container.root)
        return {self.engine.name, root, root.rstrip("/"), *self.settings.aliases}

    def check_model(self, model: str) -> None:
        if model not in self.model_names():
            raise s.APIError(404, f"the model {model!r} does not exist; this server serves "
                             f"{self.engine.name!r}", param="model", code="model_not_found")

    def limit_tokens(self, req: s.ChatRequest | s.CompletionRequest, params: SamplingParams) -> SamplingParams:
        """Refuse a completion longer than the server allows; cap one that names no length."""
        limit = self.settings.max_tokens_limit
        if (getattr(req, "max_completion_tokens", None) or req.max_tokens) is None:
            return msgspec.structs.replace(params, max_tokens=min(params.max_tokens or limit, limit))
        if params.max_tokens is not None and params.max_tokens > limit:
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise s.APIError(400, f"{param} is {params.max_tokens}, over this server's limit of {limit} "
                             "tokens per request (server.max_tokens_limit)", param=param)
        return params

    def check_prompt(self, tokens: list[int], params: SamplingParams, param: str) -> None:
        try:
            Generation(self.engine, tokens, params).check()
        except PromptTooLong as exc:
            raise s.APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise s.APIError(400, str(exc), param=param) from None
        self.drain.check_open()
        if self.engine.waiting >= self.settings.max_queue:
            raise s.APIError(429, f"the server is busy: {self.engine.waiting} requests are "
                             "waiting; retry later", type="rate_limit_error", code="queue_full")

    # --- routes ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """503 while shutting down or when a container file is gone, truncated or unreadable:
        a load balancer then stops sending requests that could only fail."""
        if self.drain.stopping:
            return json_response({"status": "shutting_down", "model": self.engine.name}, 503)
        c = self.engine.container
        problems = await trio.to_thread.run_sync(unreadable_files, c.root, c.manifest)
        if problems:
            log.warning("server.unhealthy", problems=problems[:5])
            return json_response({"status": "error", "model": self.engine.name,
                                  "problems": problems}, 503)
        return json_response({"status": "ok", "model": self.engine.name})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(self.engine),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        return json_response(s.ModelList([s.ModelCard(self.engine.name, self.created)]))

    async def model(self, request: Request) -> Response:
        self.check_auth(request)
        self.check_model(request.path_params["model"])
        return json_response(s.ModelCard(self.engine.name, self.created))

    async def chat(self, request: Request) -> Response:
        self.check_auth(request)
        req: s.ChatRequest = s.decode_request(await self.read_body(request), s.ChatRequest)
        s.check_unsupported(req)
        self.check_model(req.model)
        params = self.limit_tokens(req, s.sampling_params(req, self.settings.defaults))
        messages = template_messages(req.messages)
        tools = [msgspec.to_builtins(t) for t in req.tools or []]
        if isinstance(req.tool_choice, s.NamedToolChoice):
            wanted = req.tool_choice.function.name
            if wanted not in {t.function.name for t in req.tools or []}:
                raise s.APIError(400, f"tool_choice names {wanted!r}, which is not in tools",
                                 param="tool_choice")
        if req.tool_choice == "none":
            tools = []
        try:
            extra = template_kwargs(self.engine.config.chat, None, req.chat_template_kwargs)
        except TemplateKwargsError as exc:
            raise s.APIError(400, str(exc), param=f"chat_template_kwargs.{exc.key}") from None
        try:
            text = self.engine.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True,
                **({"tools": tools} if tools else {}), **extra)
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise s.APIError(400, f"the chat template refused the messages: {exc}",
                             param="messages") from None
        tokens = self.engine.encode(text)
        self.check_prompt(tokens, params, "messages")
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        reply = ChatReply(self.engine, self.metrics, req, tools=bool(tools), schemas=schemas,
                          in_reasoning=text.rstrip().endswith("<think>"),
                          hide_reasoning=self.settings.hide_reasoning)
        reply.drain = self.drain
        return await respond(request, reply, tokens, params)

    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        req: s.CompletionRequest = s.decode_request(await self.read_body(request),
                                                    s.CompletionRequest)
        s.check_unsupported(req)
        self.check_model(req.model)
        params = self.limit_tokens(req, s.sampling_params(req, self.settings.defaults))
        prompt = req.prompt
        if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise s.APIError(400, f"prompt must be one string or a list of token ids, got "
                                 f"a list of {len(prompt)} items with strings", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = self.engine.encode(prompt)
        else:
            tokens = [int(t) for t in prompt]
        self.check_prompt(tokens, params, "prompt")
        reply = TextReply(self.engine, self.metrics, req)
        reply.drain = self.drain
        return await respond(request, reply, tokens, params)


def template_messages(messages: list[s.Message]) -> list[dict[str, Any]]:
    """Request messages as the chat template wants them (tool-call arguments as dicts)."""
    if not messages:
        raise s.APIError(400, "messages must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text(m.content, f"messages[{i}].content")}
        if m.tool_calls:
            if m.role != "assistant":
                raise s.APIError(400, f"only assistant messages carry tool_calls, not {m.role!r}",
                                 param=f"messages[{i}].tool_calls")
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    args = json.loads(call.function.arguments or "{}")
                except ValueError as exc:
                    raise s.APIError(400, f"tool call arguments are not JSON: {exc}",
                                     param=f"messages[{i}].tool_calls[{j}].function.arguments"
                                     ) from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _text(content: str | list[s.ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise s.APIError(400, f"content part type {part.type!r} is not supported (only "
                             "'text' parts with a text field)", param=f"{param}[{j}].type")
        texts.append(part.text)
    return "".join(texts)


def _guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """OpenAI error bodies for refusals; a generic 500 (logged, never a traceback) otherwise."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except s.APIError as exc:
            log.info("server.refused", path=request.url.path, status=exc.status, reason=exc.message)
            return _error(exc)
        except Exception as exc:
            log.error("server.internal_error", path=request.url.path, exc_info=exc)
            return _error(s.APIError(500, "internal server error", type="server_error"))

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = s.APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
    else:
        err = s.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return _error(err)


def create_app(engine: Engine, settings: ServerSettings | None = None,
               metrics: Metrics | None = None, drain: Drain | None = None) -> ASGIApp:
    api = Api(engine, settings or ServerSettings(), metrics or Metrics(), drain)
    routes = [
        Route("/health", _guarded(api.health), methods=["GET"]),
        Route("/metrics", _guarded(api.metrics_text), methods=["GET"]),
        Route("/v1/models", _guarded(api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", _guarded(api.model), methods=["GET"]),
        Route("/v1/chat/completions", _guarded(api.chat), methods=["POST"]),
        Route("/v1/completions", _guarded(api.completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return _StatusCounter(app, api.metrics)


async def serve_engine(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    max_queue: int = 16,
    max_body_bytes: int = 1 << 20,
    max_tokens_limit: int = 8192,
    hide_reasoning: bool = False,
    aliases: tuple[str, ...] = (),
    defaults: SamplingParams | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    shutdown_grace_s: float = 5.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `engine` until `shutdown_trigger` returns (or forever); reports the bound port.

    Port 0 binds a free port: `port = await nursery.start(serve_engine, engine, host, 0)`.
    Once `shutdown_trigger` returns, requests in flight get `shutdown_grace_s` to finish.
    """
    settings = ServerSettings(api_key=api_key, max_queue=max_queue, max_body_bytes=max_body_bytes,
                              max_tokens_limit=max_tokens_limit,
                              hide_reasoning=hide_reasoning, aliases=aliases,
                              defaults=defaults or default_params(engine))
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = shutdown_grace_s

    async def started(binds: list[str]) -> None:
        bound = int(binds[0].rsplit(":", 1)[1])
        log.info("server.listening", host=host, port=bound, model=engine.name)
        task_status.started(bound)

    drain = Drain()

    async def shut_down() -> None:
        if shutdown_trigger is None:
            await trio.sleep_forever()
        else:
            await shutdown_trigger()
        # Replies still producing tokens get most of hypercorn's graceful period.
        await drain.shut_down(grace_s=max(0.0, config.graceful_timeout - 1.5))

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        await serve(create_app(engine, settings, drain=drain), config,  # type: ignore[arg-type]
                    shutdown_trigger=shut_down, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        await started(binds)
