"""Test helpers for the HTTP server: a real server on loopback."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pipeline.config.loading import config_from_dict
from pipeline.engine import Engine, open_engine
from pipeline.server.app import serve_engine
from pipeline.server.settings import ServerSettings


def own_copy(container: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A copy of a session-packed container that a module may damage or lock."""
    out = tmp_path_factory.mktemp(name) / container.name
    shutil.copytree(container, out)
    return out


@asynccontextmanager
async def serving(container: Path, server: dict[str, Any] | None = None,
                  prefill_chunk: int = 4, max_batch: int = 8,
                  **serve_kw: Any) -> AsyncIterator[tuple[Engine, int]]:
    """An engine on `container` served on a free loopback port; yields (engine, port).

    `server` is the config's [server] section (e.g. context_limit); `serve_kw` are more
    ServerSettings (api_key, max_queue, max_body_bytes, ...) and serve_engine's
    `shutdown_trigger`. A larger `prefill_chunk` makes
    long prompts (tool definitions) cheaper; `max_batch` 1 makes requests queue one
    behind the other.
    """
    cfg = config_from_dict({"model": {"path": str(container)}, "pool": {"slots": 16},
                            "compute": {"prefill_chunk": prefill_chunk, "max_batch": max_batch}, "prefetch": {"strategy": "next-gate"},
                            "server": server or {}})
    async with open_engine(cfg) as engine, trio.open_nursery() as nursery:
        trigger = serve_kw.pop("shutdown_trigger", None)
        settings = ServerSettings.of(cfg.server, port=0, **serve_kw)
        port = await nursery.start(lambda task_status: serve_engine(
            engine, settings, shutdown_trigger=trigger, task_status=task_status))
        yield engine, port
        nursery.cancel_scope.cancel()
