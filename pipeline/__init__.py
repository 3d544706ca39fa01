"""moestream's pipeline: the engine and its faces (library, CLI, server, benchmarks).

Layers point one way: `qpack` (the container format) <- `actors` (the trio tasks, the
expert pool, prefetch, reads, sampling) <- `pipeline` (model, engine, faces).

    from pipeline import open_engine, load_config, SamplingParams, TextDelta, Done

    async with open_engine(load_config("config/demo.toml")) as engine:
        async for event in engine.generate("Hello", SamplingParams(max_tokens=16)):
            ...

Names are loaded on first use, so `import pipeline.cli` stays light (no MLX).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qpack.log_default import log_to_stderr_by_default

log_to_stderr_by_default()  # not stdout, where generated text goes

if TYPE_CHECKING:
    from actors.sampling_params import SamplingParams
    from pipeline.config.errors import ConfigError
    from pipeline.config.loading import config_from_dict, load_config
    from pipeline.config.schema import PipelineConfig
    from pipeline.engine import Engine, open_engine
    from pipeline.events import Done, Event, GenerationStats, TextDelta

__all__ = [
    "ConfigError",
    "Done",
    "Engine",
    "Event",
    "GenerationStats",
    "PipelineConfig",
    "SamplingParams",
    "TextDelta",
    "config_from_dict",
    "load_config",
    "open_engine",
]

_WHERE = {
    "ConfigError": "pipeline.config.errors",
    "Done": "pipeline.events",
    "Engine": "pipeline.engine",
    "Event": "pipeline.events",
    "GenerationStats": "pipeline.events",
    "PipelineConfig": "pipeline.config.schema",
    "SamplingParams": "actors.sampling_params",
    "TextDelta": "pipeline.events",
    "config_from_dict": "pipeline.config.loading",
    "load_config": "pipeline.config.loading",
    "open_engine": "pipeline.engine",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
