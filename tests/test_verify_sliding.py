"""A verify pass over sliding-window layers (gpt-oss's RotatingKVCache rings, a window of
4 in the tiny preset) is plain decode's, bit for bit: every position's logits, and after
`keep(n)` every ring (buffer, offset, write position) and every later step's logits, for
each n, before and after the rings wrap, on rings left by a prefill and by decode."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from helpers_engine import engine_config
from helpers_forward import DirectForward, tiny_pair

from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.engine_hooks import emulate_drafts
from pipeline.events import Done, TextDelta
from pipeline.models.streamed import ForwardStep
from pipeline.models.verify_step import VerifyStep, can_verify
from pipeline.prefix_cache import _arrays
from pipeline.speculation import EmulatedDrafts

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]
DRAFT = [5, 4242, 77, 9]  # the pass's tokens after the last one


@pytest.fixture(scope="module")
def ours(synth_checkpoint, packed):
    qpack = tiny_pair(synth_checkpoint, packed, "gpt_oss", None)[1]
    forward = DirectForward(qpack)
    yield forward
    forward.close()


def _run(ours: DirectForward, step: ForwardStep) -> mx.array:
    routing = step.run_to_routing()
    while routing is not None:
        routing = step.advance(ours._place(routing.layer, np.unique(routing.ids).tolist()))
    return step.logits(all_positions=True)


def _state(cache: list[Any]) -> list[tuple[Any, ...]]:
    """A ring whole (its order is what later steps sum in); a plain KV cache up to its
    offset (what lies past it, a rejected draft's keys, the next write overwrites)."""
    def held(c: Any, a: mx.array) -> mx.array:
        return a if hasattr(c, "max_size") else a[..., : c.offset, :]

    return [(c.offset, getattr(c, "_idx", None), held(c, c.keys), held(c, c.values)) for c in cache]


def _assert_same(a: list[Any], b: list[Any]) -> None:
    for (offset, idx, keys, values), (offset_b, idx_b, keys_b, values_b) in zip(
            _state(a), _state(b), strict=True):
        assert (offset, idx) == (offset_b, idx_b)
        assert keys.shape == keys_b.shape and mx.array_equal(keys, keys_b).item()
        assert mx.array_equal(values, values_b).item()


def test_the_tiny_gpt_oss_has_rings_and_verifies(ours):
    model = ours.model
    assert can_verify(model)
    sliding = [i for i in model.layers if model.family.is_sliding(model.parts.layers[i])]
    assert sliding and type(model.make_cache()[sliding[0]]).__name__ == "RotatingKVCache"


@pytest.mark.parametrize("before", [
    [PROMPT[:2]],  # the rings not yet full: the pass fills and wraps them
    [PROMPT],  # a prefill's ring (time order, window - 1 + T long)
    [PROMPT, [3], [17]],  # a decoded ring, wrapped (15 positions through a window of 4)
])
def test_a_pass_and_any_kept_prefix_are_plain_decode_bit_for_bit(ours, before):
    def primed() -> list[Any]:
        cache = ours.make_cache()
        for tokens in before:
            _run(ours, ForwardStep(ours.model, tokens, cache))
        return cache

    # Plain decode of the pass's tokens, one at a time: logits and caches after each.
    last = 100
    tokens = [last, *DRAFT]
    plain = primed()
    plain_logits, plain_after = [], []
    for t in tokens:
        plain_logits.append(_run(ours, ForwardStep(ours.model, [t], plain))[0])
        plain_after.append(primed())
        for u in tokens[: len(plain_after)]:
            _run(ours, ForwardStep(ours.model, [u], plain_after[-1]))
    cache = primed()
    step = VerifyStep(ours.model, tokens, cache)
    logits = _run(ours, step)
    for j, want in enumerate(plain_logits):
        assert mx.array_equal(logits[j], want).item(), f"position {j}"
    _assert_same(cache, plain_after[-1])  # the whole pass kept: no keep() call
    for n in (2, len(tokens), 1, 3):  # each from the pass, in any order
        step.keep(n)
        _assert_same(cache, plain_after[n - 1])
    # After keeping 3 positions, the next steps decode as plain decode's did.
    for t in (61, 62, 63, 64, 65):
        want = _run(ours, ForwardStep(ours.model, [t], plain_after[2]))
        assert mx.array_equal(_run(ours, ForwardStep(ours.model, [t], cache)), want).item()
    _assert_same(cache, plain_after[2])


async def _run_engine(engine: Any, prompt: list[int], params: SamplingParams) -> tuple[Done, tuple[Any, ...]]:
    """The generation's end and every token's log-probabilities."""
    events = [e async for e in engine.generate(list(prompt), params)]
    assert isinstance(events[-1], Done)
    return events[-1], tuple(p for e in events if isinstance(e, TextDelta) for p in e.logprobs)


async def _stored(engine: Any, tokens: list[int]) -> list[Any]:
    state, n = await engine._core.worker.run(engine.prefix_cache.take, [*tokens, 0])
    assert n == len(tokens)
    return state


@pytest.mark.parametrize(("layout", "slots", "run_ahead", "draft"), [
    ("hub", 8, "on", 3),  # the smallest pool: passes that miss, resumed per layer; k cut to 1
    ("mxfp4", 16, "off", 3),  # the release's mxfp4 experts, per layer, reads in every pass
])
async def test_speculating_gives_plain_tokens_logprobs_and_stored_state(
        synth_checkpoint, packed, layout, slots, run_ahead, draft):
    """Greedy with log-probabilities through the engine, 13 + 12 positions through windows of
    4: drafts kept and rejected give plain decode's tokens and log-probabilities, leave the
    state plain decode leaves in the prefix cache (bit for bit), and a follow-up that
    reuses that state while it speculates again continues as plain decode does."""
    if layout == "hub":
        qpack = tiny_pair(synth_checkpoint, packed, "gpt_oss", None)[1]
    else:
        qpack = packed(synth_checkpoint("gpt_oss", dtype="float32", layout="mxfp4"))
    config = engine_config(qpack, pool={"slots": slots}, compute={"run_ahead": run_ahead})
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    spec = msgspec.structs.replace(greedy, speculative="ngram")
    async with open_engine(config) as engine:
        plain, plain_lp = await _run_engine(engine, PROMPT, greedy)
        kept = [*PROMPT, *plain.token_ids[:-1]]
        want_state = await _stored(engine, kept)
        follow_up = [*PROMPT, *plain.token_ids, 5, 6]
        plain_next, next_lp = await _run_engine(engine, follow_up, greedy)  # from that state
        assert plain_next.stats.cached_tokens == len(kept)

        engine.prefix_cache.clear()
        engine._core.batch.speculation.max_draft = draft
        emulate_drafts(engine, EmulatedDrafts(plain.token_ids, 0.6, seed=5))
        got, got_lp = await _run_engine(engine, PROMPT, spec)
        assert (got.token_ids, got_lp) == (plain.token_ids, plain_lp) and len(got_lp) == 12
        s = got.stats
        assert s.verify_passes > 0 and 0 < s.drafts_accepted < s.drafts_proposed
        assert (engine._core.compute.stats.run_ahead_misses > 0) == (run_ahead == "on")
        for a, b in zip(_arrays(await _stored(engine, kept)), _arrays(want_state), strict=True):
            assert mx.array_equal(a, b).item()
        emulate_drafts(engine, EmulatedDrafts(plain_next.token_ids, 0.6, seed=6))
        again, again_lp = await _run_engine(engine, follow_up, spec)
        assert again.stats.cached_tokens == len(kept) and again.stats.verify_passes > 0
        assert (again.token_ids, again_lp) == (plain_next.token_ids, next_lp)
