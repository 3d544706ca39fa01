"""Which drafted tokens a verify pass keeps, exactly as plain decode would have drawn them.

Position i's logits in a verify pass are the ones plain decode computes after the same
tokens, so the row's own sampler draws position i's token from them, in order, with its
own state (RNG key, penalty counts, grammar, log-probabilities), and the pass keeps
drafts while the drawn token equals the draft; the first disagreement (or, all drafts
kept, the last position) gives one more token, the model's own. Greedy or seeded, that
is the very token sequence plain decode draws. For a deterministic draft (prompt lookup,
an argmax MTP draft: q one-hot) it is also standard speculative sampling: the draft is
kept with probability p(draft) = min(1, p/q), and a disagreement is a draw from p
without the draft, renormalised: the residual max(0, p - q).

`speculative_sample` is the general rule, for drafts drawn from a distribution q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from actors.sampler import Sampler
from actors.token_logprob import TokenLogprob


@dataclass
class Verdict:
    tokens: list[int]  # the pass's tokens: the drafts kept, then the model's own
    logprobs: list[tuple[TokenLogprob, ...]]  # each token's (empty when not asked for)

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def accept(sampler: Sampler, logits: mx.array, draft: Sequence[int]) -> Verdict:
    """On the MLX thread: `logits` [len(draft) + 1, vocab], evaluated. Records the tokens."""
    if sampler.lazy_ok:
        return _accept_lazy(sampler, logits, draft)
    tokens: list[int] = []
    logprobs: list[tuple[TokenLogprob, ...]] = []
    for i in range(len(draft) + 1):
        mark = sampler.logprobs_mark()
        token = sampler.sample(logits[i])
        tokens.append(token)
        logprobs.append(sampler.hold_logprobs(mark))
        if i == len(draft) or token != draft[i]:
            break
    return Verdict(tokens, logprobs)


def _accept_lazy(sampler: Sampler, logits: mx.array, draft: Sequence[int]) -> Verdict:
    # Draws that depend only on the logits and the key: all positions in one sync, then
    # the key goes back to where plain decode would have it after the tokens kept.
    keys, draws = [], []
    for i in range(len(draft) + 1):
        keys.append(sampler.key)
        draws.append(sampler.draw(logits[i]))
    drawn = cast(list[int], mx.stack(draws).tolist())
    n = next((i + 1 for i, d in enumerate(draft) if drawn[i] != d), len(draft) + 1)
    if n < len(keys):
        sampler.restore_key(keys[n])
    for t in drawn[:n]:
        sampler.record(t)
    return Verdict(drawn[:n], [()] * n)


def speculative_sample(p: mx.array, q: mx.array, draft: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    `p`, `q` [N, vocab]: the target's and the drafter's probabilities at N positions;
    `draft` [N]: tokens drawn from q. Keeps draft i with probability min(1, p/q), else
    draws from the residual normalise(max(0, p - q)). Returns (token [N], kept [N]): the
    token is distributed as p whatever q is.
    """
    k_u, k_r = mx.random.split(key)
    rows = mx.arange(p.shape[0])
    pd, qd = p[rows, draft], q[rows, draft]
    u = mx.random.uniform(shape=pd.shape, key=k_u)
    kept = u * qd < pd  # u < p/q without dividing by a zero q
    residual = mx.maximum(p - q, 0.0)
    # Where p <= q everywhere the draft is always kept; the residual is then never used.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    redraw = mx.random.categorical(mx.log(residual), key=k_r)
    return mx.where(kept, draft, redraw), kept
