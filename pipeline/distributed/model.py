"""A rank's streamed model: its slice of the layers, with the boundary at the end.

The compute actor drives it exactly as it drives the whole model (`step`, then
`run_to_routing` / `advance` per MoE layer, then `logits`): the pool, the router and the
prefetcher of each rank see only that rank's layers. Only `logits` differs:
- rank 0 (embeds): sends the residual stream on and waits for the last rank's logits;
- a middle rank: hands its residual stream back to the stage loop, which sends it on;
- the last rank: the head, as in one process.
A later rank's `step` starts from the residual stream the stage loop received
(`StageModel.inbox`); the token ids it is given are placeholders for their count.

Every sequence's caches carry an id (`seqs`, one per row; a decode batch's merged caches
carry their rows'), and the batch operations carry the ids through merge, extend, keep
and extract (`StageBatchCaches`): the later ranks key their caches by these ids and
regroup their own batch as rank 0's, from the ids alone (`worker.StageLoop`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from pipeline.distributed.plan import StagePlan
from pipeline.models.batch_caches import BatchCaches
from pipeline.models.run_ahead import state_arrays
from pipeline.models.streamed import ForwardStep, StreamedModel


class Boundary(Protocol):
    """What a rank's model needs of its stage (`Stage`, pipeline/distributed/stage.py):
    its plan, and rank 0's crossing to the later ranks and back."""

    plan: StagePlan

    def exchange(self, h: mx.array, seqs: list[int], all_positions: bool,
                 decode: bool) -> mx.array: ...


class SequenceCache(list[Any]):
    """A sequence's caches (one per layer), or a batch's, tagged with its rows' ids."""

    seqs: list[int]


def with_seqs(cache: list[Any], seqs: Sequence[int]) -> list[Any]:
    """`cache` tagged with `seqs` (a tagged list subclass, e.g. calibrated routing's
    `Routed`, keeps its class and takes the attribute)."""
    out = SequenceCache(cache) if type(cache) is list else cache
    out.seqs = list(seqs)  # type: ignore[attr-defined]  # a tagged list subclass takes it
    return out


def seqs_of(cache: Sequence[Any]) -> list[int]:
    """The ids of the rows of `cache` (0 for caches that were never tagged)."""
    return list(getattr(cache, "seqs", [0]))


class StageBatchCaches(BatchCaches):
    """The decode batch's cache operations, carrying the rows' sequence ids along."""

    def merge(self, caches: Sequence[list[Any]]) -> list[Any]:
        return with_seqs(super().merge(caches), [s for c in caches for s in seqs_of(c)])

    def extend(self, batch: list[Any], caches: Sequence[list[Any]]) -> None:
        ids = seqs_of(batch) + [s for c in caches for s in seqs_of(c)]
        super().extend(batch, caches)
        batch.seqs = ids  # type: ignore[attr-defined]  # merged caches are a tagged list

    def extract(self, batch: list[Any], row: int) -> list[Any]:
        return with_seqs(super().extract(batch, row), [seqs_of(batch)[row]])

    def keep(self, batch: list[Any], rows: Sequence[int]) -> None:
        ids = seqs_of(batch)
        super().keep(batch, rows)
        batch.seqs = [ids[r] for r in rows]  # type: ignore[attr-defined]  # as in extend


_SEQUENCES = itertools.count(1)


def new_seq() -> int:
    """A sequence id no rank has seen."""
    return next(_SEQUENCES)


class StageModel(StreamedModel):
    def __init__(self, stage: Boundary, model: Any, fmt: Any, slot_arrays: dict[str, mx.array],
                 activation_dtype: mx.Dtype | None = None, **kwargs: Any) -> None:
        super().__init__(model, fmt, slot_arrays, activation_dtype, layers=stage.plan.layers,
                         **kwargs)
        self.stage = stage
        self.inbox: mx.array | None = None  # a later rank: the residual stream received

    def make_cache(self) -> list[Any]:
        return with_seqs(super().make_cache(), [new_seq()])

    def batch_caches(self) -> StageBatchCaches:
        return StageBatchCaches(self.layers)

    # A rank's step wraps the whole model's ForwardStep (StageStep hands on what it does
    # not change), so it is no ForwardStep subclass: the override's return type differs.
    def step(self, tokens: list[int] | mx.array, cache: list[Any]) -> StageStep:  # type: ignore[override]
        if self.stage.plan.first:
            inner = super().step(tokens, cache)
        else:
            assert self.inbox is not None, "a later rank's step without a residual stream"
            inner, self.inbox = self.step_from(self.inbox, cache), None
        return StageStep(inner, self.stage, cache, phase_decode=_is_decode(tokens))


    def step_after(self, tokens: list[int], cache: list[Any], before: int) -> None:
        """No pairing across ranks: each rank's steps cross the boundary one forward at a
        time, in the order rank 0 runs them."""
        return None


def _is_decode(tokens: list[int] | mx.array) -> bool:
    return isinstance(tokens, mx.array) or len(tokens) == 1


class StageStep:
    """A `ForwardStep` whose `logits` crosses the boundary; everything else is the step's."""

    def __init__(self, inner: ForwardStep, stage: Boundary, cache: list[Any], phase_decode: bool):
        self.inner = inner
        self.stage = stage
        self.cache = cache
        self.decode = phase_decode

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run_to_routing(self, *args: Any) -> Any:
        return self.inner.run_to_routing(*args)

    def advance(self, *args: Any) -> Any:
        return self.inner.advance(*args)

    def _evaluated_stream(self) -> mx.array:
        states = [a for c in self.cache for a in state_arrays(c.state)]  # nested: quantized KV
        mx.eval(self.inner.h, states)
        return self.inner.h

    def logits(self, all_positions: bool = False) -> mx.array:
        plan = self.stage.plan
        if plan.last:
            return self.inner.logits(all_positions)
        h = self._evaluated_stream()
        if not plan.first:
            return h  # the stage loop sends it on
        out = self.stage.exchange(h, seqs_of(self.cache), all_positions, self.decode)
        # A decode step fed as rows ([1, 1]: the decoder's shape) wants [rows, vocab].
        return out[None] if self.inner.rows and out.ndim == 1 else out
