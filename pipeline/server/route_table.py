"""Every HTTP route, once: its path, method, handler and what it is for.

The app's routes (`create_app`), the metrics' route labels and `moestream serve --help`
are all read from `ROUTES`; adding a route is adding a row. Handlers are named as
"module.function" of `pipeline.server` (resolved when the app is made), so this table
imports nothing and the CLI can describe the routes without loading the engine.
"""

from __future__ import annotations

from typing import NamedTuple


class RouteSpec(NamedTuple):
    path: str  # without the /v1 prefix
    method: str
    handler: str  # "routes_openai.chat"; "health" and "metrics" are the app's own
    help: str
    v1: bool = True  # also under /v1 (OpenAI's and Anthropic's clients add it; Ollama's never)


ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec("/chat/completions", "POST", "routes_openai.chat", "OpenAI chat, tools, SSE"),
    RouteSpec("/completions", "POST", "routes_openai.completions", "OpenAI text completions"),
    RouteSpec("/responses", "POST", "routes_responses.create", "OpenAI Responses API"),
    RouteSpec("/messages", "POST", "routes_anthropic.messages", "Anthropic Messages API"),
    RouteSpec("/messages/count_tokens", "POST", "routes_anthropic.count_tokens",
              "Anthropic token count"),
    RouteSpec("/models", "GET", "routes_openai.models", "the model and its aliases"),
    RouteSpec("/models/{model:path}", "GET", "routes_openai.model", "one model"),
    RouteSpec("/tokenize", "POST", "routes_openai.tokenize", "text to token ids"),
    RouteSpec("/detokenize", "POST", "routes_openai.detokenize", "token ids to text"),
    RouteSpec("/api/chat", "POST", "routes_ollama.chat", "Ollama chat", v1=False),
    RouteSpec("/api/generate", "POST", "routes_ollama.generate", "Ollama generate", v1=False),
    RouteSpec("/api/tags", "GET", "routes_ollama_models.tags", "Ollama model list", v1=False),
    RouteSpec("/api/show", "POST", "routes_ollama_models.show", "Ollama model details", v1=False),
    RouteSpec("/api/ps", "GET", "routes_ollama_models.ps", "Ollama running models", v1=False),
    RouteSpec("/api/version", "GET", "routes_ollama_models.version", "Ollama version", v1=False),
    *(RouteSpec(f"/api/{verb}", method, "routes_ollama_models.not_managed",
                "Ollama model management: refused in one line", v1=False)
      for verb, method in (("pull", "POST"), ("push", "POST"), ("create", "POST"),
                           ("copy", "POST"), ("delete", "DELETE"))),
    RouteSpec("/", "GET", "root", "200 'moestream is running' (Ollama's clients ping it)",
              v1=False),
    RouteSpec("/health", "GET", "health", "503 when the container is damaged or the server "
              "stops", v1=False),
    RouteSpec("/metrics", "GET", "metrics", "Prometheus metrics", v1=False),
)


def paths(spec: RouteSpec) -> tuple[str, ...]:
    """Where `spec` answers: its path, and its /v1 twin."""
    return (spec.path, "/v1" + spec.path) if spec.v1 else (spec.path,)


def _labels() -> tuple[str, ...]:
    # A route's label is its own path (each /v1 twin apart); a sub-route or a path with a
    # parameter counts under the route it extends (/v1/messages/count_tokens: /v1/messages).
    tops = [r for r in ROUTES if "{" not in r.path
            and not any(r.path.startswith(o.path + "/") for o in ROUTES if o is not r)]
    return tuple(p for r in tops for p in paths(r))


# Metric labels: the routes, the /v1 prefix's variants counted apart; anything else "other".
LABELS: tuple[str, ...] = _labels()


def label(path: str) -> str:
    return next((p for p in LABELS if path == p or path.startswith(p + "/")), "other")


def describe() -> str:
    """The routes, for `serve --help`."""
    listed = "; ".join(f"{r.method} {'/v1' if r.v1 else ''}{r.path} ({r.help})"
                       for r in ROUTES if "{" not in r.path)
    return f"{listed}. Each /v1 route also answers without /v1."
