"""The OpenAI-compatible HTTP face: a starlette app over one open engine, served by hypercorn/trio.

    async with open_engine(config) as engine:
        await serve_engine(engine, ServerSettings.of(config.server, api_key="..."))

Every request is checked (auth, body size, JSON, fields, model, prompt length, queue)
before a response starts, so refusals are proper OpenAI error bodies with the right
status. Generations run in the request's task: a client that goes away cancels its
task, and `aclosing` hands the engine's generator back at once (the engine drains
its reads and unpins the pool). Concurrent requests decode together in the engine's
batch (up to `compute.max_batch` rows); the others wait in FIFO order, up to
`server.max_queue` of them (then 429).

The routes are one table (`route_table.ROUTES`: path, method, handler, help), each
answering with and without the `/v1` prefix where its clients may add one. This module
wires the app: api.py holds the shared checks, routes_*.py the handlers, responses.py
and the other reply modules build the bodies. Browser UIs need CORS, which is off unless
origins are listed (`cors_origins`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.config.errors import ConfigError
from pipeline.container_damage import damage_log
from pipeline.distributed.errors import RankLost
from pipeline.engine import Engine
from pipeline.server import (
    routes_anthropic,
    routes_ollama,
    routes_ollama_models,
    routes_openai,
    routes_responses,
)
from pipeline.server import schema as s
from pipeline.server.api import Api
from pipeline.server.drain import Drain
from pipeline.server.hypercorn_fix import close_idle_connections_at_eof
from pipeline.server.metrics import Metrics
from pipeline.server.route_table import ROUTES, RouteSpec
from pipeline.server.route_table import label as route_label
from pipeline.server.route_table import paths as route_paths
from pipeline.server.settings import ServerSettings
from pipeline.server.transport import json_response
from qpack.checked_files import unreadable_files

log = structlog.get_logger("moestream.server")


__all__ = ["ServerSettings", "create_app", "serve_engine"]

# The modules the route table names its handlers in.
_HANDLER_MODULES = {"routes_openai": routes_openai, "routes_responses": routes_responses,
                    "routes_anthropic": routes_anthropic, "routes_ollama": routes_ollama,
                    "routes_ollama_models": routes_ollama_models}


ErrorBody = Callable[[s.APIError], dict[str, Any]]

# An idle keep-alive connection is closed by the client first: httpx (the openai and
# anthropic clients) drops its pooled ones after 5 s, hypercorn's own default. At equal
# timeouts a request sent as the server closed its connection failed ("Connection error":
# one of 1,105 requests in session 30's 50-minute soak, clients without retries); a server
# behind a proxy wants its idle timeout above the proxy's (60 s for many).
KEEP_ALIVE_S = 75.0

# Route prefix -> the shape of that API's error bodies (OpenAI's everywhere else).
ERROR_BODIES: dict[str, ErrorBody] = {"/messages": s.APIError.anthropic_body,
                                      "/api/": s.APIError.ollama_body}


def error_body_for(path: str) -> ErrorBody:
    return next((b for prefix, b in ERROR_BODIES.items() if path.startswith(prefix)),
                s.APIError.body)


def _error(exc: s.APIError, body: ErrorBody = s.APIError.body) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return json_response(body(exc), exc.status, headers)


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
        label = route_label(path)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.record_request(label, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


def _guarded(handler: Callable[[Request], Awaitable[Response]],
             body: ErrorBody = s.APIError.body) -> Callable[[Request], Awaitable[Response]]:
    """Error bodies for refusals (OpenAI's, or the route's API's: `ERROR_BODIES`); a
    generic 500 (logged, never a traceback) otherwise."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except s.APIError as exc:
            log.info("server.refused", path=request.url.path, status=exc.status, reason=exc.message)
            return _error(exc, body)
        except RankLost as exc:  # a distributed job lost a rank: the model is gone, not the request wrong
            return _error(s.APIError(503, f"the model is unavailable: {exc}", type="server_error",
                                     code="rank_lost"), body)
        except Exception as exc:
            if (damaged := s.damage_error(exc)) is not None:  # known and named: no traceback
                log.warning("server.container_damaged", path=request.url.path,
                            reason=damaged.message)
                return _error(damaged, body)
            log.error("server.internal_error", path=request.url.path, exc_info=exc)
            return _error(s.APIError(500, "internal server error", type="server_error"), body)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = s.APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
    else:
        err = s.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return _error(err, error_body_for(request.url.path))


def create_app(engine: Engine, settings: ServerSettings | None = None,
               metrics: Metrics | None = None, drain: Drain | None = None) -> ASGIApp:
    api = Api(engine, settings or ServerSettings(), metrics or Metrics(), drain)

    async def health(request: Request) -> Response:
        """503 while shutting down, when a container file is gone, truncated or unreadable,
        or once a read found an expert damaged (until its file is mended): a load
        balancer then stops sending requests that could only fail."""
        if api.drain.stopping:
            return json_response({"status": "shutting_down", "model": engine.name}, 503)
        c = engine.container
        damaged = damage_log(c)

        def examine() -> list[str]:
            return unreadable_files(c.root, c.manifest) + damaged.problems(c.root, c.manifest)

        problems = await trio.to_thread.run_sync(examine)
        if problems:
            log.warning("server.unhealthy", problems=problems[:5])
            # Without the key (when there is one) a prober learns that, not which files.
            shown = problems if api.authorized(request) else [
                f"{len(problems)} container files unreadable (send the API key for which)"]
            return json_response({"status": "error", "model": engine.name,
                                  "problems": shown}, 503)
        return json_response({"status": "ok", "model": engine.name})

    async def metrics_text(request: Request) -> Response:
        if not api.settings.metrics_without_key:
            api.check_auth(request)
        return Response(api.metrics.render(engine),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def root(request: Request) -> Response:
        # Ollama's CLI and libraries check a server with GET or HEAD / before anything else.
        return Response("moestream is running", media_type="text/plain; charset=utf-8")

    own = {"health": health, "metrics": metrics_text, "root": root}

    def handler_of(spec: RouteSpec) -> Callable[[Request], Awaitable[Response]]:
        if spec.handler in own:
            return _guarded(own[spec.handler])
        module, _, name = spec.handler.partition(".")
        handler = getattr(_HANDLER_MODULES[module], name)
        return _guarded(partial(handler, api), error_body_for(spec.path))

    routes = [Route(path, handler_of(spec), methods=[spec.method])
              for spec in ROUTES for path in route_paths(spec)]
    app: ASGIApp = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    if api.settings.cors_origins:
        app = CORSMiddleware(app, allow_origins=list(api.settings.cors_origins),
                             allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                             max_age=600)
    return _StatusCounter(app, api.metrics)


async def serve_engine(
    engine: Engine,
    settings: ServerSettings | None = None,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `engine` by `settings` (`ServerSettings.of(config.server)`; host, port, key,
    limits) until `shutdown_trigger` returns (or forever); reports the bound port.

    Port 0 binds a free port: `port = await nursery.start(serve_engine, engine, settings)`.
    Once `shutdown_trigger` returns, requests in flight get `shutdown_grace_s` to finish.
    """
    settings = settings or ServerSettings()
    if settings.defaults is None:
        settings = msgspec.structs.replace(settings, defaults=engine.default_params())
    assert settings.defaults is not None
    host, port = settings.host, settings.port
    try:  # the config's [sampling] logit_bias, refused at start rather than per request
        settings.defaults.check_vocab(engine.facts.vocab_size)
    except ValueError as exc:
        raise ConfigError(f"sampling.{exc}") from None
    close_idle_connections_at_eof()
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = settings.shutdown_grace_s
    config.keep_alive_timeout = KEEP_ALIVE_S

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
        # hypercorn types its app as its own ASGI framework protocol; starlette's (and the
        # counting middleware's) ASGI callable is one, spelled with other type names.
        await serve(create_app(engine, settings, drain=drain), config,  # type: ignore[arg-type]
                    shutdown_trigger=shut_down, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        await started(binds)
