"""Token sampling with OpenAI request semantics.

`Sampler` turns one step's logits into one token id; it owns the RNG and the token counts
the penalties need, so one `Sampler` belongs to one sequence. The knobs are
`SamplingParams` (actors/sampling_params.py); text and stop strings are
`TextStream`'s (actors/text_stream.py).

Order of operations (as in HF transformers and vLLM, so results are comparable with
the usual OpenAI-compatible servers): repetition penalty (prompt + generated), frequency
and presence penalties (generated only), logit bias, the constraint's token mask, then
greedy argmax when temperature is 0, else temperature, top-k, top-p, min-p and a
categorical draw. Temperature comes before the filters so that top-p/min-p act on the
distribution that is actually sampled; the mask comes before them so that they only
ever choose among tokens the grammar allows.

Log-probabilities (`params.logprobs`) are the model's own: a log-softmax of the raw
logits, before penalties, bias, mask and temperature (vLLM's default), so they say how
likely the model found a token, whatever forced it.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

import mlx.core as mx
import numpy as np

from actors.mx_typed import float_list, float_rows, int_list, int_rows, to_float, to_int
from actors.sampling_params import SamplingParams
from actors.token_logprob import TokenLogprob

_NEG_INF = float("-inf")
_SEED_MOD = 2**64  # mx.random.key takes an unsigned 64-bit seed


class TokenConstraint(Protocol):
    """Which tokens may come next (a grammar's state); advanced by every sampled token."""

    def allowed(self) -> np.ndarray | None:
        """A bool mask of shape [vocab] (True = allowed; never all False), or None for all."""
        ...

    def advance(self, token: int) -> None: ...


class Sampler:
    """Picks the next token of one sequence; owns its RNG stream and penalty counts.

    The RNG key is split once per `sample` call (also when greedy), so token i of a
    seeded run depends only on the seed, i and the logits — not on batch-mates, other
    requests or the global MLX RNG state.
    """

    def __init__(
        self, params: SamplingParams, vocab_size: int, prompt_tokens: Iterable[int] = ()
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size!r}")
        params.check_vocab(vocab_size)  # the last guard before ids index MLX arrays
        self.params = params
        self.vocab_size = vocab_size
        # Drawn once so that a caller can log/report it and replay the run exactly.
        self.seed: int = (
            params.seed % _SEED_MOD if params.seed is not None else secrets.randbits(63)
        )
        self._key = mx.random.key(self.seed)
        self._generated: Counter[int] = Counter()
        self._seen: set[int] = set()
        self._stop_ids = frozenset(params.stop_token_ids)
        self.constraint: TokenConstraint | None = params.constraint
        self._bias_ids = mx.array([t for t, _ in params.logit_bias], dtype=mx.uint32)
        self._bias = mx.array([b for _, b in params.logit_bias], dtype=mx.float32)
        # Log-probabilities of the tokens sampled since the last `take_logprobs`.
        self._logprobs: list[TokenLogprob] = []
        self.observe_prompt(prompt_tokens)

    @property
    def num_generated(self) -> int:
        return sum(self._generated.values())

    def observe_prompt(self, tokens: Iterable[int]) -> None:
        """Prompt tokens count for the repetition penalty only (as in HF)."""
        for t in tokens:
            self._seen.add(self._check_id(t))

    def record(self, token: int) -> None:
        """Count a generated token (done by `sample`; call directly for forced tokens)."""
        t = self._check_id(token)
        self._generated[t] += 1
        self._seen.add(t)

    def is_stop_token(self, token: int) -> bool:
        return token in self._stop_ids

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    def sample(self, logits: mx.array) -> int:
        """One token id from `logits` of shape [vocab] (or [1, vocab]); records it, keeps
        its log-probability (when asked for) and advances the constraint with it."""
        token = to_int(self.draw(logits))
        self.record(token)
        if self.params.logprobs is not None:
            raw = self._vector(logits).astype(mx.float32)
            self._logprobs.append(self.logprob_of(raw, token, self.params.logprobs))
        if self.constraint is not None:
            self.constraint.advance(token)
        return token

    @property
    def lazy_ok(self) -> bool:
        """Whether `draw` may run before the previous token is known on the host.

        Penalties read the generated tokens' counts on the host, a constraint's mask
        depends on the previous token, and log-probabilities are read per sampled token,
        so with any of them each draw needs the last token first (`sample`); without them
        a draw depends only on the logits and the RNG stream (logit_bias is static), and
        decode can be pipelined.
        """
        p = self.params
        return (p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                and p.presence_penalty == 0.0 and p.constraint is None
                and p.logprobs is None)

    def draw(self, logits: mx.array) -> mx.array:
        """The next token as a lazy [] array (not recorded: see `record`).

        Splits the RNG key once, as `sample` does; `key` / `restore_key` let a caller that
        throws a draw away redraw it identically.
        """
        logits = self._vector(logits)
        self._key, step_key = mx.random.split(self._key)
        x = self.process(logits.astype(mx.float32))
        if self.params.greedy:
            return mx.argmax(x)
        return mx.random.categorical(x, key=step_key)

    def _vector(self, logits: mx.array) -> mx.array:
        if logits.ndim == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.ndim != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(
                f"logits must have shape [{self.vocab_size}], got {list(logits.shape)}"
            )
        return logits

    @property
    def key(self) -> mx.array:
        return self._key

    def restore_key(self, key: mx.array) -> None:
        self._key = key

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of the tokens sampled since the last call (empty when off)."""
        out = tuple(self._logprobs)
        self._logprobs.clear()
        return out

    def logprobs_mark(self) -> int:
        """How many sampled tokens' log-probabilities wait to be taken (see `hold_logprobs`)."""
        return len(self._logprobs)

    def hold_logprobs(self, mark: int) -> tuple[TokenLogprob, ...]:
        """Take back those sampled since `mark`: a speculative pass draws tokens before they
        are handed out, and gives each token's back (`give_logprobs`) when it is."""
        held = tuple(self._logprobs[mark:])
        del self._logprobs[mark:]
        return held

    def give_logprobs(self, entries: tuple[TokenLogprob, ...]) -> None:
        self._logprobs.extend(entries)

    @staticmethod
    def logprob_of(logits: mx.array, token: int, top: int) -> TokenLogprob:
        lp = logits - mx.logsumexp(logits)
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            ids = mx.argpartition(-lp, kth=top - 1)[:top]
            values = float_list(lp[ids])
            pairs = sorted(zip(int_list(ids), values, strict=True), key=lambda p: -p[1])
            best = tuple((int(i), float(v)) for i, v in pairs)
        return TokenLogprob(token, to_float(lp[token]), best)

    def process(self, logits: mx.array) -> mx.array:
        """Penalties, temperature and filters; returns float32 logits (-inf = excluded).

        Greedy stops after the penalties: temperature and filters cannot change argmax.
        """
        p = self.params
        x = self.apply_penalties(logits.astype(mx.float32))
        if p.logit_bias:
            x = mx.put_along_axis(x, self._bias_ids, x[self._bias_ids] + self._bias, axis=0)
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            if allowed is not None:
                x = mx.where(mx.array(allowed[: self.vocab_size]), x, _NEG_INF)
        if p.greedy:
            return x
        if p.temperature != 1.0:
            x = x / p.temperature
        if 0 < p.top_k < self.vocab_size:
            x = _top_k(x, p.top_k)
        if p.top_p < 1.0:
            x = _top_p(x, p.top_p)
        if p.min_p > 0.0:
            x = _min_p(x, p.min_p)
        return x

    def apply_penalties(self, logits: mx.array) -> mx.array:
        """Repetition (HF, prompt+generated), then frequency/presence (OpenAI, generated).

        Touches only the ids seen so far (a gather and a functional scatter, so the
        caller's array is never modified), not the whole vocab.
        """
        p = self.params
        x = logits
        if p.repetition_penalty != 1.0 and self._seen:
            ids = mx.array(sorted(self._seen), dtype=mx.uint32)
            sel = x[ids]
            sel = mx.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
            x = mx.put_along_axis(x, ids, sel, axis=0)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and self._generated:
            keys = sorted(self._generated)
            ids = mx.array(keys, dtype=mx.uint32)
            counts = mx.array([self._generated[k] for k in keys], dtype=mx.float32)
            sel = x[ids] - counts * p.frequency_penalty - p.presence_penalty
            x = mx.put_along_axis(x, ids, sel, axis=0)
        return x

    def _check_id(self, token: int) -> int:
        t = int(token)
        if not (0 <= t < self.vocab_size):
            raise ValueError(f"token id {t} outside vocab [0, {self.vocab_size})")
        return t


def _top_k(x: mx.array, k: int) -> mx.array:
    # argpartition keeps exactly k ids even with ties (a threshold compare would keep more).
    keep = mx.argpartition(-x, kth=k - 1)[:k]
    out = mx.full(x.shape, _NEG_INF, dtype=mx.float32)
    out[keep] = x[keep]
    return out


def _top_p(x: mx.array, top_p: float) -> mx.array:
    order = mx.argsort(-x)
    probs = mx.softmax(x[order])
    # Keep a token if the mass before it is < top_p: the most likely one always stays,
    # and the token that crosses top_p is included (nucleus as in HF and vLLM).
    before = mx.cumsum(probs) - probs
    keep_sorted = before < top_p
    keep = mx.zeros(x.shape, dtype=mx.bool_)
    keep[order] = keep_sorted
    return mx.where(keep, x, _NEG_INF)


def _min_p(x: mx.array, min_p: float) -> mx.array:
    # p >= min_p * p_max  <=>  logit >= log(min_p) + logit_max (no softmax needed).
    threshold = mx.max(x) + math.log(min_p)
    return mx.where(x >= threshold, x, _NEG_INF)


def prompt_logprobs(logits: mx.array, targets: list[int], top: int) -> list[TokenLogprob]:
    """`targets[i]`'s log-probability under `logits[i]` ([n, vocab], all positions of a
    prefill chunk), with the `top` most likely tokens there; the model's own numbers."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    ids = mx.array(targets, dtype=mx.uint32)[:, None]
    chosen = float_list(mx.take_along_axis(lp, ids, axis=-1)[:, 0])
    best_ids: list[list[int]] = [[] for _ in targets]
    best_lp: list[list[float]] = [[] for _ in targets]
    if top > 0:
        order = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
        best_ids = int_rows(order)
        best_lp = float_rows(mx.take_along_axis(lp, order, axis=-1))
    out = []
    for t, c, bi, bl in zip(targets, chosen, best_ids, best_lp, strict=True):
        pairs = sorted(zip(bi, bl, strict=True), key=lambda p: -p[1])
        out.append(TokenLogprob(int(t), float(c), tuple((int(i), float(v)) for i, v in pairs)))
    return out
