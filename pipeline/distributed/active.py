"""The stage this process runs as, while it is one rank of a distributed job.

A process is one rank for its whole life, so `open_engine` asks here rather than every
face (generate, chat, run, serve) passing the stage down: set by `activate`, read by
`active_stage`. This module imports nothing heavy, so the engine can ask without a cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.distributed.stage import Stage

_active: Stage | None = None


def active_stage() -> Stage | None:
    return _active


@contextmanager
def activate(stage: Stage) -> Iterator[Stage]:
    global _active
    previous, _active = _active, stage
    try:
        yield stage
    finally:
        _active = previous
