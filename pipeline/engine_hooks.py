"""What only a benchmark (or a test of what one measures) does to an open engine.

Route by a routing model instead of the model's routers, draft from a reference run's
own tokens, forget what `auto` speculation measured. None of it belongs on `Engine`, the
user's API (a server or a program has no use for them and must not reach them by
accident): like `trio.testing` beside trio, they are engine modules' functions that
reach its private core, and the bench (a face, which may not: tests/test_layers.py)
calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.engine import Engine
    from pipeline.models.routing_override import RoutingOverride
    from pipeline.speculation import EmulatedDrafts


def use_routing(engine: Engine, override: RoutingOverride | None) -> None:
    """Route every later generation by `override` (calibrated routing, `bench --routing`)
    instead of the model's routers; None restores them."""
    engine._core.model.routing = override


def emulate_drafts(engine: Engine, drafts: EmulatedDrafts | None) -> None:
    """Every later speculating generation drafts from `drafts` (a reference run's tokens,
    a seeded fraction corrupted: docs/speculative.md) instead of its drafter; None
    restores the drafters."""
    engine._core.emulated_drafts = drafts


def reset_speculation(engine: Engine) -> None:
    """Forget what `auto` measured (pass prices, acceptance, back-off), as a freshly
    opened engine would, e.g. after a warm-up that compiled the passes."""
    engine._core.batch.speculation = engine._core.batch.speculation.fresh()


async def forget_prefixes(engine: Engine) -> None:
    """Drop every kept prompt state (pipeline/prefix_cache.py), on the MLX thread where the
    cache's operations run: a measured request after a warm-up then holds what a fresh
    engine's first request does, not the warm-up's state copies as well (a 1024-token
    prompt's two were ~170 MiB at the 35B's dims, counted as MLX temporaries)."""
    core = engine._core
    await core.worker.run(core.prefix_cache.clear)
