"""Ollama's model routes: `/api/tags` (the model and its aliases), `/api/show` (template,
family, quantization, capabilities), `/api/ps` (the running model), `/api/version`, and
the model management ones (`/api/pull`, `push`, `create`, `copy`, `delete`), refused in one
line: a server runs the one container it was started with.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from importlib import metadata
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.server import schema as s
from pipeline.server.api import Api
from pipeline.server.transport import json_response


def _details(api: Api) -> dict[str, Any]:
    manifest = api.engine.container.manifest
    fmt = manifest.layers[0].format
    quant = "F16" if fmt.bits is None else f"{fmt.mode or 'affine'} {fmt.bits}-bit"
    family = manifest.model_type
    return {"parent_model": "", "format": "qpack", "family": family, "families": [family],
            "parameter_size": "", "quantization_level": quant}


def _modified(api: Api) -> str:
    root = api.engine.container.root
    return datetime.fromtimestamp(root.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")


def _model_entry(api: Api, name: str, size: int) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": _modified(api), "size": size,
            "digest": api.fingerprint.removeprefix("fp_"), "details": _details(api)}


async def tags(api: Api, request: Request) -> Response:
    """`size`: the container on disk (its files summed once, whatever the aliases)."""
    api.check_auth(request)
    root = api.engine.container.root
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return json_response({"models": [_model_entry(api, n, size) for n in api.listed_names()]})


class ShowBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # older clients' key
    verbose: bool = False


async def show(api: Api, request: Request) -> Response:
    body: ShowBody = await api.decode(request, ShowBody)
    api.check_model(body.model or body.name)
    template = str(getattr(api.engine.tokenizer, "chat_template", None) or "")
    capabilities = ["completion"]
    capabilities += ["tools"] if "tools" in template else []
    capabilities += ["thinking"] if "<think>" in template else []
    details = _details(api)
    info = {"general.architecture": details["family"],
            f"{details['family']}.context_length": api.engine.context_limit}
    return json_response({"modelfile": "", "parameters": "", "template": template,
                          "details": details, "model_info": info,
                          "capabilities": capabilities,
                          "modified_at": _modified(api)})


# Ollama's `expires_at` for a model kept loaded for good (keep_alive < 0): Go's
# now + the longest duration, ~292 years; `ollama ps` shows it as "Forever".
_FOREVER_DAYS = 292 * 365


async def ps(api: Api, request: Request) -> Response:
    """The running model: always this one, loaded for the server's life. `size` is what
    it holds in memory (the dense core and the expert pool, not the container on disk);
    `size_vram` the same where those live on a GPU (0 on MLX's CPU backend)."""
    api.check_auth(request)
    import mlx.core as mx

    facts = api.engine.facts
    held = facts.dense_bytes + facts.pool_bytes
    on_gpu = mx.default_device() == mx.gpu
    expires = datetime.now(UTC) + timedelta(days=_FOREVER_DAYS)
    stamp = expires.isoformat().replace("+00:00", "Z")
    models = [{**_model_entry(api, n, held), "size_vram": held if on_gpu else 0,
               "expires_at": stamp, "context_length": api.engine.context_limit}
              for n in api.listed_names()]
    return json_response({"models": models})


async def not_managed(api: Api, request: Request) -> Response:
    """/api/pull, /api/push, /api/create, /api/copy, /api/delete: a server runs the one
    container it was started with; say so, and how to get another, in one line."""
    api.check_auth(request)
    raise s.APIError(400, f"moestream serves the container it was started with "
                          f"({api.engine.name}): {request.url.path} manages no models; pack "
                          "a checkpoint with `moestream pack REPO -o MODEL.qpack` and serve it "
                          "with `moestream serve MODEL.qpack`")


async def version(api: Api, request: Request) -> Response:
    try:
        ours = metadata.version("moestream")
    except metadata.PackageNotFoundError:
        ours = "0"
    return json_response({"version": ours})
