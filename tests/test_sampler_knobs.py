"""The sampler's per-request knobs (logit bias, token masks, log-probabilities), and
Sampler.draw (the lazy token pipelined decode builds on) against Sampler.sample: which
knobs allow drawing before the previous token is on the host."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_sampler import VOCAB, _logits

from actors.sampler import Sampler
from actors.sampling_params import SamplingParams


class _Allow:
    """A constraint that allows a fixed set of ids and records what it was advanced by."""

    def __init__(self, ids: list[int]) -> None:
        self.mask = np.zeros(VOCAB, dtype=bool)
        self.mask[ids] = True
        self.seen: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def advance(self, token: int) -> None:
        self.seen.append(token)


def test_logit_bias_is_added_before_sampling() -> None:
    logits = _logits(3)
    low = int(np.argmin(logits))
    bias = ((low, 100.0), (int(np.argmax(logits)), -100.0))
    s = Sampler(SamplingParams(temperature=0, logit_bias=bias), VOCAB)
    out = np.array(s.process(mx.array(logits)))
    ref = logits.copy()
    ref[low] += 100.0
    ref[int(np.argmax(logits))] -= 100.0
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    assert s.sample(mx.array(logits)) == low


def test_constraint_mask_limits_every_draw_and_is_advanced() -> None:
    logits = _logits(4)
    allowed = [int(i) for i in np.argsort(logits)[:3]]  # the three least likely tokens
    greedy = _Allow(allowed)
    s = Sampler(SamplingParams(temperature=0, constraint=greedy), VOCAB)
    assert s.sample(mx.array(logits)) == max(allowed, key=lambda i: logits[i])
    free = _Allow(allowed)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=1, constraint=free), VOCAB)
    draws = [s.sample(mx.array(logits)) for _ in range(200)]
    assert set(draws) <= set(allowed) and free.seen == draws


def test_logprobs_are_the_raw_log_softmax_with_sorted_alternatives() -> None:
    logits = _logits(5)
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    s = Sampler(SamplingParams(temperature=1.0, seed=2, logprobs=4,
                               logit_bias=((0, 50.0),)), VOCAB)
    token = s.sample(mx.array(logits))
    (entry,) = s.take_logprobs()
    assert entry.token == token == 0  # biased, yet reported with the model's own logprob
    assert entry.logprob == pytest.approx(float(ref[0]), abs=1e-5)
    assert [t for t, _ in entry.top] == [int(i) for i in np.argsort(-logits)[:4]]
    assert [lp for _, lp in entry.top] == pytest.approx(sorted(ref, reverse=True)[:4], abs=1e-5)
    assert s.take_logprobs() == ()
    off = Sampler(SamplingParams(), VOCAB)
    off.sample(mx.array(logits))
    assert off.take_logprobs() == ()



def test_lazy_only_without_host_state_per_token() -> None:
    """Penalties, a grammar and logprobs need each token on the host before the next draw;
    logit_bias is static, so a biased sampler still draws lazily."""
    assert Sampler(SamplingParams(), VOCAB).lazy_ok
    assert Sampler(SamplingParams(logit_bias=((3, 5.0),), seed=1), VOCAB).lazy_ok
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(repetition_penalty=1.1),
                   SamplingParams(frequency_penalty=0.2), SamplingParams(logprobs=0),
                   SamplingParams(constraint=_Allow([1, 2]))):
        assert not Sampler(params, VOCAB).lazy_ok, params


def test_lazy_draws_with_bias_match_sample() -> None:
    """draw + record (the pipelined path) picks what sample picks, bias applied, for a
    seeded stream; a key restored before a redraw gives the same token again."""
    logits = mx.array(_logits(7))
    low = int(np.argmin(_logits(7)))
    params = SamplingParams(temperature=1.0, seed=11, logit_bias=((low, 8.0),))
    eager, lazy = Sampler(params, VOCAB), Sampler(params, VOCAB)
    sampled = [eager.sample(logits) for _ in range(50)]
    drawn = []
    for _ in range(50):
        key = lazy.key
        token = lazy.draw(logits)
        lazy.restore_key(key)
        again = lazy.draw(logits)
        assert int(token.item()) == int(again.item())
        drawn.append(int(again.item()))
        lazy.record(drawn[-1])
    assert drawn == sampled and low in drawn
    assert lazy.num_generated == eager.num_generated == 50


def test_sample_keeps_logprobs_and_advances_the_constraint_every_token() -> None:
    logits = mx.array(_logits(8))
    allowed = _Allow([4, 9, 20])
    s = Sampler(SamplingParams(temperature=1.0, seed=3, logprobs=2, constraint=allowed), VOCAB)
    tokens = [s.sample(logits) for _ in range(5)]
    entries = s.take_logprobs()
    assert [e.token for e in entries] == tokens == allowed.seen
    assert set(tokens) <= {4, 9, 20} and all(len(e.top) == 2 for e in entries)
