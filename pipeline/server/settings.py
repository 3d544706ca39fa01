"""What a server runs by: the config's `[server]` keys, and what only its caller says.

A server setting is spelled once, in `ServerConfig` (pipeline/config/schema.py: its type,
range, default and comment); `ServerSettings` adds the three things no config file
holds (the CLI's `--hide-reasoning`, the names it accepts, the resolved sampling
defaults). `serve_engine(engine, settings)` takes one of these:

    settings = ServerSettings.of(config.server, hide_reasoning=True)
    await serve_engine(engine, settings)
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.sampling_params import SamplingParams
from pipeline.config.schema import ServerConfig


class ServerSettings(ServerConfig, frozen=True, kw_only=True):
    # Reasoning (`<think>`) left out of replies (`serve --hide-reasoning`).
    hide_reasoning: bool = False
    # Names accepted but not listed (the path the CLI was given).
    accepted: tuple[str, ...] = ()
    # A request's sampling defaults; None: the engine's (`Engine.default_params`).
    defaults: SamplingParams | None = None

    @classmethod
    def of(cls, server: ServerConfig, **more: Any) -> ServerSettings:
        """`server`'s keys, with `more` (any key of either) on top."""
        return cls(**{**msgspec.structs.asdict(server), **more})
