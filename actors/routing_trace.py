"""Routing traces: what every MoE layer chose, per step, recorded from a live run.

A trace holds the model's shape, the live pool settings, and per step (one decode token,
or one prefill chunk) and phase, per MoE layer:

- `chosen`: the experts the pool was asked for, each once, in the order the router first
  chose them (for a prefill chunk, the union over its tokens);
- `predictions`: the live strategy's predictions made right after that layer (the live
  engine predicts only at decode steps, so prefill entries have none);
- `tokens`: each token's own top-k in router order, i.e. what the strategy observed, one
  `observe` per token; left empty when it is the single row `chosen` (every decode step),
  which keeps files small.

Version 1 traces had no `tokens`: their prefill chunks replay with the merged set as a
single observation, which is not what the live engine learned (loaded with a warning).
Recorded predictions let `moestream replay` rerun gate-based strategies, which need the
model, without it. See pipeline/replay.py for the replay semantics.

Stored as JSON (readable, diffable); a path ending in ".gz" is gzip-compressed.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog

from qpack.output_guard import write_file_atomically

log = structlog.get_logger(__name__)

Phase = Literal["prefill", "decode"]
TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)


class TraceModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int
    stride: int  # bytes per expert read (the container's largest expert stride)
    # Most slots one pool array indexes right (actors/pool/banks.py): a replay past it cuts
    # its pool into banks as the live engine does. 0: one bank at every size.
    bank_limit: int = 0


class TracePool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_slots: int
    policy: str
    policy_params: dict[str, float] = {}
    strategy: str = "none"
    strategy_params: dict[str, Any] = {}


class TraceLayer(msgspec.Struct, array_like=True, forbid_unknown_fields=True, omit_defaults=True):
    # array_like keeps the file small: [layer, chosen, predictions, tokens] per entry, with
    # trailing empty fields left out
    layer: int
    chosen: list[int]
    predictions: list[tuple[int, list[int]]] = []
    tokens: list[list[int]] = []

    def observed(self) -> list[list[int]]:
        """What the strategy observed at this layer: one top-k row per token."""
        return self.tokens or [self.chosen]


class TraceStep(msgspec.Struct, forbid_unknown_fields=True):
    phase: Phase
    seq: int  # prompt (sequence) index: strategies reset when it changes
    layers: list[TraceLayer] = []


class RoutingTrace(msgspec.Struct, forbid_unknown_fields=True):
    model: TraceModel
    pool: TracePool
    steps: list[TraceStep] = []
    version: int = TRACE_VERSION

    def validate(self, source: str = "trace") -> None:
        """Raise ValueError naming the step and layer of the first inconsistent entry."""
        if self.version not in READABLE_VERSIONS:
            raise ValueError(
                f"{source}: trace version {self.version}, expected one of {READABLE_VERSIONS}"
            )
        moe = set(self.model.moe_layers)
        n = self.model.num_experts
        for s, step in enumerate(self.steps):
            for entry in step.layers:
                where = f"{source}: step {s} layer {entry.layer}"
                if entry.layer not in moe:
                    raise ValueError(f"{where}: layer is not in moe_layers")
                bad = [e for e in entry.chosen if not 0 <= e < n]
                if bad or len(set(entry.chosen)) != len(entry.chosen):
                    raise ValueError(
                        f"{where}: chosen {entry.chosen} has ids out of [0, {n}) or duplicates"
                    )
                for target, ids in entry.predictions:
                    if target not in moe or any(not 0 <= e < n for e in ids):
                        raise ValueError(f"{where}: bad prediction ({target}, {ids})")
                union = {e for row in entry.tokens for e in row}
                if entry.tokens and (union != set(entry.chosen) or any(
                    not row or len(set(row)) != len(row) for row in entry.tokens
                )):
                    raise ValueError(
                        f"{where}: per-token rows {entry.tokens} do not make up chosen "
                        f"{entry.chosen} (rows must be non-empty, without duplicates)"
                    )


def save_trace(trace: RoutingTrace, path: str | Path) -> Path:
    path = Path(path)
    data = msgspec.json.encode(trace)
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=6)
    # Never a half-written trace under the real name, nor a temporary left beside it.
    return write_file_atomically(path, data)


def load_trace(path: str | Path) -> RoutingTrace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"routing trace {path}: cannot read: {exc}") from exc
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise ValueError(f"routing trace {path}: corrupt gzip: {exc}") from exc
    try:
        trace = msgspec.json.decode(data, type=RoutingTrace)
    except msgspec.DecodeError as exc:
        raise ValueError(f"routing trace {path}: not a valid trace: {exc}") from exc
    trace.validate(str(path))
    if trace.version == 1 and any(step.phase == "prefill" for step in trace.steps):
        log.warning(
            "routing_trace.merged_prefill",
            path=str(path),
            note="version 1 trace: prefill chunks hold only their merged routing, so "
            "history/transition replay approximately; record again for an exact replay",
        )
    return trace


class TraceRecorder:
    """Called by the engine: `begin_token(phase)` per step, `record(...)` per MoE layer."""

    def __init__(self, model: TraceModel, pool: TracePool) -> None:
        self.trace = RoutingTrace(model=model, pool=pool)
        self._seq = 0
        self._step: TraceStep | None = None

    def begin_sequence(self) -> None:
        """A new prompt starts; replayed strategies get reset_sequence() here."""
        if self.trace.steps:
            self._seq += 1

    def begin_token(self, phase: Phase) -> None:
        if phase not in ("prefill", "decode"):
            raise ValueError(f"TraceRecorder.begin_token: phase {phase!r} not prefill/decode")
        self._step = TraceStep(phase=phase, seq=self._seq)
        self.trace.steps.append(self._step)

    def record(
        self,
        layer: int,
        chosen: Sequence[int],
        predictions: Sequence[tuple[int, Sequence[int]]] = (),
        tokens: Iterable[Iterable[int]] | None = None,
    ) -> None:
        """One MoE layer of the current step.

        `chosen`: the experts demanded from the pool (union, router order); `predictions`:
        what the live strategy predicted after this layer; `tokens`: each token's top-k
        row as the strategy observed it (e.g. the router's [tokens, k] id array). Without
        `tokens` the step is taken to be one token whose row is `chosen`.
        """
        if self._step is None:
            raise RuntimeError("TraceRecorder.record called before begin_token")
        ids = [int(e) for e in chosen]
        rows = [[int(e) for e in row] for row in tokens] if tokens is not None else []
        if len(rows) == 1 and rows[0] == ids:
            rows = []  # the common decode case: implied by chosen
        self._step.layers.append(
            TraceLayer(
                layer=int(layer),
                chosen=ids,
                predictions=[(int(t), [int(e) for e in ids]) for t, ids in predictions],
                tokens=rows,
            )
        )

    def save(self, path: str | Path) -> Path:
        return save_trace(self.trace, path)

    @staticmethod
    def load(path: str | Path) -> RoutingTrace:
        return load_trace(path)
