"""Which speculation a generation gets: the request's `speculative`, else the engine's
`compute.speculative`; a drafter for it, or none (docs/speculative.md).

"ngram" drafts by prompt lookup (any model); "mtp" needs a container with the
checkpoint's MTP head; "auto" takes the MTP head when the container has one, prompt
lookup otherwise, and lets the policy stop where speculating loses. Speculation is
never a reason for different tokens, so nothing else about a request changes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from actors.sampling_params import SamplingParams
from actors.speculative.decoder import Drafter, RowSpeculation
from actors.speculative.emulated import EmulatedDrafter
from actors.speculative.ngram import NgramDrafter
from actors.speculative.policy import SpecStats, SpeculationPolicy
from pipeline.models.verify_step import VerifyStep, can_verify

if TYPE_CHECKING:
    from pipeline.engine import Engine

NGRAM_MAX, NGRAM_MIN = 3, 2  # the longest suffix looked up first; shorter matches are noise


def mode_of(engine: Engine, params: SamplingParams) -> str:
    return params.speculative or engine.config.compute.speculative


def has_mtp(engine: Engine) -> bool:
    return getattr(engine, "mtp", None) is not None


def check(engine: Engine, params: SamplingParams) -> None:
    """Refuse a mode this container cannot serve (one line, before the request runs)."""
    if mode_of(engine, params) == "mtp" and not has_mtp(engine):
        raise ValueError('speculative = "mtp" needs a container packed with the checkpoint\'s '
                         'MTP head; this one has none (use "ngram" or "auto")')


def policy_for(engine_slots: int, top_k: int, draft_tokens: int) -> SpeculationPolicy:
    """The engine's policy; its guard keeps a pass's experts within what the pool can pin."""
    return SpeculationPolicy(max_draft=draft_tokens, pinnable_rows=engine_slots // top_k)


def row_speculation(engine: Engine, params: SamplingParams, tokens: list[int],
                    max_tokens: int) -> RowSpeculation | None:
    mode = mode_of(engine, params)
    if mode == "off" or engine.batch.speculation.longest < 1:
        return None
    if not can_verify(engine.model):
        return None  # a layout whose DeltaNet states a pass could not restore
    emulated = engine.emulated_drafts
    drafter: Drafter
    if emulated is not None:
        drafter = emulated.drafter(tokens, engine.model.parts.args.vocab_size)
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
    whatever the mode says, once `engine.emulated_drafts` is set to one of these."""

    def __init__(self, reference: Sequence[int], acceptance: float, seed: int = 0) -> None:
        self.reference, self.acceptance, self.seed = list(reference), acceptance, seed

    def drafter(self, prompt: Sequence[int], vocab: int) -> EmulatedDrafter:
        return EmulatedDrafter(prompt, self.reference, self.acceptance, vocab, self.seed)


def speculation_snapshot(stats: SpecStats) -> dict[str, float]:
    """The engine's speculation counters, for `pool_snapshot` and /metrics."""
    return {"verify_passes": stats.passes, "drafts_proposed": stats.proposed,
            "drafts_accepted": stats.accepted, "pass_tokens": stats.pass_tokens,
            "speculative_backoffs": stats.backoffs}
