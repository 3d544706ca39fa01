"""What the compute actor needs from a model: a forward pass it can step layer by layer.

The pipeline's streamed model implements these protocols; actors depend only on them,
so the layers point one way (qpack <- actors <- pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from actors.slot_map import SlotMap

# presync(layer, hidden) -> more lazy arrays to evaluate with a layer's routing.
Presync = Callable[[int, mx.array], Sequence[mx.array]]


@dataclass
class Routing:
    """A MoE layer's true routing, as the host sees it."""

    layer: int
    ids: np.ndarray  # [tokens, top_k] expert ids
    hidden: mx.array  # residual stream after this layer's attention block, [tokens, H]


def unique_in_order(ids: np.ndarray) -> list[int]:
    """Experts a layer needs, each once, in the order the router first chose them."""
    return list(dict.fromkeys(int(e) for e in ids.reshape(-1)))


class RunAheadResult(Protocol):
    """An evaluated run-ahead: the logits, valid when no MoE layer missed."""

    logits: mx.array

    def first_miss(self) -> int | None: ...


class LaunchedRunAhead(Protocol):
    """A run-ahead still lazy (its arrays queued), evaluated by `result`."""

    logits: mx.array

    def arrays(self) -> list[mx.array]: ...

    def result(self) -> RunAheadResult: ...


class ForwardStepper(Protocol):
    """One forward call over some tokens, stopped at each MoE layer's routing."""

    def run_to_routing(self, presync: Presync | None = None) -> Routing | None: ...

    def advance(self, slot_of: np.ndarray, presync: Presync | None = None) -> Routing | None: ...

    def logits(self, all_positions: bool = False) -> mx.array: ...

    # The whole decode token in one evaluation (experts looked up on the device), and
    # stepping on per layer from the layer a run-ahead missed at.
    def run_ahead(self, slot_map: SlotMap) -> RunAheadResult: ...

    def launch(self, slot_map: SlotMap) -> LaunchedRunAhead: ...

    def resume(self, layer: int, presync: Presync | None = None) -> Routing | None: ...


class CacheBatcher(Protocol):
    """Several sequences' caches as one batch (rows in order), and back."""

    def merge(self, caches: Sequence[list[Any]]) -> list[Any]: ...

    def extend(self, batch: list[Any], caches: Sequence[list[Any]]) -> None: ...

    def extract(self, batch: list[Any], row: int) -> list[Any]: ...

    def keep(self, batch: list[Any], rows: Sequence[int]) -> None: ...


class SteppedModel(Protocol):
    # The step reads its token ids on the host (an embedding kept on file): a lazy token
    # is waited for before the step is built, so queueing it early overlaps nothing.
    tokens_on_host: bool

    def step(self, tokens: list[int] | mx.array, cache: list[Any]) -> ForwardStepper:
        """`tokens`: one sequence's ids, or [rows, tokens] for a batch of merged caches."""
        ...

    def batch_caches(self) -> CacheBatcher: ...
