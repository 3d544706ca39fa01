"""`moestream serve MODEL`: the OpenAI-compatible server, until SIGINT/SIGTERM.

The engine is opened once for the server's life; a signal starts hypercorn's graceful
shutdown (in-flight requests get `graceful_timeout` to finish, then are cancelled),
then the engine closes and the command exits 0.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipeline.cli.commands import add_engine_flags, engine_config
from pipeline.cli.term import err
from pipeline.failures import refused
from pipeline.server.route_table import describe as describe_routes

_SERVER_FLAGS = ("host", "port", "api_key", "max_queue", "max_body_bytes", "context_limit",
                 "max_tokens_limit", "strict_model", "aliases", "cors_origins",
                 "metrics_without_key", "prefix_cache_dir")


def server_overrides(args: argparse.Namespace) -> list[str]:
    """The server flags given, as `server.key=value` config overrides (TOML values)."""
    overrides: list[str] = []
    for flag in _SERVER_FLAGS:
        value: Any = getattr(args, flag)
        if value is not None and value != []:
            # JSON's string, bool and list forms are TOML's too; numbers stay bare.
            text = str(value) if isinstance(value, int) and not isinstance(value, bool) \
                else json.dumps(value)
            overrides.append(f"server.{flag}={text}")
    return overrides


def _cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from pipeline.config.errors import ConfigError
    from pipeline.prepare import ensure_container
    from pipeline.server.serve import check_bindable, serve_config

    args.overrides = [*server_overrides(args), *args.overrides]
    try:
        cfg = engine_config(args, args.model)
    except (ConfigError, ValueError) as exc:
        return refused(exc)
    if cfg.distributed.enabled:  # rank 0 serves; the others run their layers
        from pipeline.cli.commands import distributed

        def face(c: Any, stage: Any) -> int:
            check_bindable(c.server.host, c.server.port)
            err.print(f"rank 0 of a distributed job: serving on http://{c.server.host}:{c.server.port} ...")
            return trio.run(lambda: serve_config(c, hide_reasoning=args.hide_reasoning,
                                                 accepted=(args.model,), stage=stage))

        return distributed(cfg, face, server=True)
    check_bindable(cfg.server.host, cfg.server.port)  # before minutes of packing or loading
    try:
        ensure_container(cfg.model)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        return refused(exc)
    err.print(f"loading {cfg.model.path}, then serving on http://{cfg.server.host}:{cfg.server.port} ...")
    return trio.run(lambda: serve_config(cfg, hide_reasoning=args.hide_reasoning,
                                         accepted=(args.model,)))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (chat, completions, tools, SSE)",
        description=f"Serve MODEL over an OpenAI-compatible API: {describe_routes()} "
        "Stops cleanly on Ctrl-C / SIGTERM.")
    p.add_argument("model", help="path of a .qpack container (its name is the model id)")
    h = p.add_argument_group("server")
    h.add_argument("--host", help="address to bind (default 127.0.0.1; binding another host "
                   "without --api-key logs a warning)")
    h.add_argument("--port", type=int, help="port to bind (default 8000; 0: any free one, "
                   "logged by the server.listening event)")
    h.add_argument("--api-key", help="require `Authorization: Bearer <key>` (or `x-api-key`) "
                   "on every route but /health, and on /metrics unless --metrics-without-key; "
                   "/health then names unreadable files only to callers with the key")
    h.add_argument("--metrics-without-key", action="store_true", default=None,
                   help="with --api-key: leave /metrics open (a Prometheus scraper without the key)")
    h.add_argument("--max-queue", type=int, help="requests that may wait; more get 429 (default 16)")
    h.add_argument("--max-body-bytes", type=int, help="largest request body; more get 413 "
                   "(default 1 MiB)")
    h.add_argument("--context-limit", type=int, help="prompt + completion tokens at most "
                   "(default: the model's max_position_embeddings)")
    h.add_argument("--alias", dest="aliases", action="append", default=[],
                   help="another model name to answer to and list in /v1/models; repeatable")
    h.add_argument("--strict-model", action="store_true", default=None,
                   help="404 for a request naming another model (default: serve it anyway)")
    h.add_argument("--cors-origin", dest="cors_origins", action="append", default=[],
                   help="a browser origin allowed to call the API (CORS), e.g. "
                   "http://localhost:3000, or * for any; repeatable; none by default")
    h.add_argument("--max-tokens-limit", type=int, help="most tokens one request may generate; "
                   "more get 400 (default 8192)")
    h.add_argument("--prefix-cache-dir", help="also keep prompt-prefix states in this "
                   "directory, reloaded after a restart (server.prefix_cache_dir; default: "
                   "memory only)")
    h.add_argument("--hide-reasoning", action="store_true",
                   help="drop <think> reasoning from replies instead of sending reasoning_content")
    add_engine_flags(p)
    p.set_defaults(func=_cmd_serve)
