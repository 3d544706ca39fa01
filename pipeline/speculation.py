"""Which speculation a generation gets: the request's `speculative`, else the engine's
`compute.speculative`; a drafter for it, or none (docs/speculative.md).

"ngram" drafts by prompt lookup (any model); "mtp" needs a container with the
checkpoint's MTP head; "auto" takes the MTP head when the container has one, prompt
lookup otherwise, and lets the policy stop where speculating loses. Speculation is
never a reason for different tokens, so nothing else about a request changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from actors.sampling_params import SamplingParams
from actors.speculative.decoder import Drafter, RowSpeculation, StreamingDrafter
from actors.speculative.emulated import EmulatedDrafter
from actors.speculative.ngram import NgramDrafter
from actors.speculative.policy import SpecStats, SpeculationPolicy
from pipeline.config.schema import PipelineConfig
from pipeline.models.mtp import MtpHead, load_mtp
from pipeline.models.mtp_drafter import MtpDrafter
from pipeline.models.mtp_experts import StreamedExperts
from pipeline.models.routing_override import positions
from pipeline.models.streamed import StreamedModel
from pipeline.models.verify_step import VerifyStep, can_verify
from qpack.reader import Container

if TYPE_CHECKING:
    from pipeline.engine_core import EngineCore

NGRAM_MAX, NGRAM_MIN = 3, 2  # the longest suffix looked up first; shorter matches are noise


def mode_of(engine: EngineCore, params: SamplingParams) -> str:
    return params.speculative or engine.config.compute.speculative


def has_mtp(engine: EngineCore) -> bool:
    return engine.mtp is not None


def check(engine: EngineCore, params: SamplingParams) -> None:
    """Refuse a mode this container cannot serve (one line, before the request runs)."""
    if mode_of(engine, params) == "mtp" and not has_mtp(engine):
        if engine.container.manifest.mtp_layers:
            raise ValueError('speculative = "mtp": the MTP head is loaded only when the engine '
                             'starts with compute.speculative = "mtp" or "auto"')
        raise ValueError('speculative = "mtp" needs a container packed with the checkpoint\'s '
                         'MTP head; this one has none (use "ngram" or "auto")')


Sink = Callable[[int, mx.array], None]  # (positions after the forward, h [1, T, H])


class HiddenSinks:
    """The model's `hidden_sink` while an MTP head is loaded: the drafters fed by each
    forward, found by the forward's cache. A sequence's own cache (its prefill, its lone
    decode) finds its drafter; a decode batch's merged cache finds one per row (the
    batch says which, `regrouped`), so steps decoded in a batch reach the head too. Each
    entry holds its cache, so an id is never that of another list."""

    def __init__(self) -> None:
        self.by_cache: dict[int, tuple[list[Any], list[Sink | None]]] = {}

    def add(self, cache: list[Any], sinks: list[Sink | None]) -> None:
        self.by_cache[id(cache)] = (cache, sinks)

    def drop(self, cache: list[Any]) -> None:
        entry = self.by_cache.get(id(cache))
        if entry is not None and entry[0] is cache:
            del self.by_cache[id(cache)]

    def __call__(self, cache: list[Any], h: mx.array, behind: int = 0) -> None:
        entry = self.by_cache.get(id(cache))
        if entry is None or entry[0] is not cache:
            return
        # Each row's tokens after the forward (the caches may hold `behind` more already).
        ends = [p - behind for p in positions(cache)]
        for row, sink in enumerate(entry[1]):
            if sink is not None:
                sink(ends[row], h[row : row + 1])

    def regrouped(self, old: list[Any] | None, new: list[Any] | None,
                  rows: Sequence[RowSpeculation | None]) -> None:
        """The decode batch's caches changed (`DecodeBatch.regrouped`): its rows'
        drafters are fed from the new ones."""
        if old is not None and old is not new:
            self.drop(old)
        if new is not None:
            self.add(new, [spec.sink if spec is not None else None for spec in rows])


@dataclass
class LoadedMtp:
    """The engine's MTP head: its dense part, and its routed experts' pool (None: a
    container packed before they were streamed, whose head holds them resident)."""

    head: MtpHead
    experts: StreamedExperts | None


def mtp_wanted(config: PipelineConfig, container: Container) -> bool:
    """Whether the engine loads the container's MTP head: it has one and may speculate
    with it (it costs memory: its dense part, and its experts' pool)."""
    return (bool(container.manifest.mtp_layers) and config.compute.speculative in ("mtp", "auto")
            and not config.distributed.enabled)


def open_mtp(config: PipelineConfig, container: Container, model: StreamedModel,
             experts: StreamedExperts | None) -> LoadedMtp | None:
    """On the MLX thread: the head, when `mtp_wanted`; `experts` when the container
    streams them (`manifest.mtp_experts`)."""
    if not mtp_wanted(config, container):
        return None
    head = load_mtp(container.root, model.parts, streamed=experts is not None)
    model.hidden_sink = HiddenSinks()
    return LoadedMtp(head, experts)


def release(engine: EngineCore, cache: list[Any] | None) -> None:
    """A generation is over: its drafter stops receiving hidden states."""
    sinks = engine.model.hidden_sink
    if cache is not None and isinstance(sinks, HiddenSinks):
        sinks.drop(cache)


def policy_for(engine_slots: int, top_k: int, draft_tokens: int) -> SpeculationPolicy:
    """The engine's policy; its guard keeps a pass's experts within what the pool can pin."""
    return SpeculationPolicy(max_draft=draft_tokens, pinnable_rows=engine_slots // top_k)


def row_speculation(engine: EngineCore, params: SamplingParams, tokens: list[int],
                    max_tokens: int, cache: list[Any]) -> RowSpeculation | None:
    """Before the prompt is computed (an MTP drafter sees its hidden states), on `cache`."""
    mode = mode_of(engine, params)
    if mode == "off" or engine.batch.speculation.longest < 1 or engine.config.distributed.enabled:
        return None  # pipeline-parallel ranks would each have to keep their DeltaNet states
    if not can_verify(engine.model):
        return None  # a layout whose states a pass could not cut back (pipeline/models/verify_step.py)
    emulated = engine.emulated_drafts
    drafter: Drafter | StreamingDrafter
    if emulated is not None:
        drafter = emulated.drafter(tokens, engine.model.parts.args.vocab_size)
    elif engine.mtp is not None and mode in ("mtp", "auto"):
        mtp = MtpDrafter(engine.mtp.head, engine.model.parts, tokens, engine.model.activation_dtype,
                         engine.mtp.experts)
        assert isinstance(engine.model.hidden_sink, HiddenSinks)
        engine.model.hidden_sink.add(cache, [mtp.sink])
        return RowSpeculation(mode, mtp, max_tokens, partial(VerifyStep, engine.model), sink=mtp.sink)
    else:
        drafter = NgramDrafter(tokens, max_n=NGRAM_MAX, min_n=NGRAM_MIN)
    return RowSpeculation(mode, drafter, max_tokens, partial(VerifyStep, engine.model))


def stats_fields(spec: RowSpeculation | None) -> dict[str, Any]:
    """A generation's speculation, as `GenerationStats` fields."""
    if spec is None:
        return {}
    s = spec.stats
    return {"speculative": spec.mode, "verify_passes": s.passes, "drafts_proposed": s.proposed,
            "drafts_accepted": s.accepted, "tokens_per_pass": round(s.tokens_per_pass, 3)}


class EmulatedDrafts:
    """Benchmark-only: every generation drafts from `reference` (`EmulatedDrafter`),
    whatever the mode says, once `pipeline.engine_hooks.emulate_drafts` sets one on the core."""

    def __init__(self, reference: Sequence[int], acceptance: float, seed: int = 0,
                 longest: int | None = None) -> None:
        self.reference, self.acceptance, self.seed = list(reference), acceptance, seed
        self.longest = longest

    def drafter(self, prompt: Sequence[int], vocab: int) -> EmulatedDrafter:
        return EmulatedDrafter(prompt, self.reference, self.acceptance, vocab, self.seed, self.longest)


def speculation_snapshot(stats: SpecStats) -> dict[str, float]:
    """The engine's speculation counters, for `pool_snapshot` and /metrics."""
    return {"verify_passes": stats.passes, "drafts_proposed": stats.proposed,
            "drafts_accepted": stats.accepted, "pass_tokens": stats.pass_tokens,
            "speculative_backoffs": stats.backoffs, "shadow_drafts": stats.shadowed}


def mtp_snapshot(mtp: LoadedMtp | None) -> dict[str, float]:
    """The MTP head's own expert pool, for `pool_snapshot` (zeros without one)."""
    experts = mtp.experts if mtp is not None else None
    if experts is None:
        return {"mtp_slots": 0, "mtp_hits": 0, "mtp_misses": 0, "mtp_pool_bytes": 0}
    t = experts.pool.snapshot()
    return {"mtp_slots": t.num_slots, "mtp_hits": t.hits, "mtp_misses": t.misses,
            "mtp_pool_bytes": experts.nbytes}
