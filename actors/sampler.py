"""Token sampling with OpenAI request semantics, and stop-string matching on streamed text.

`SamplingParams` is the request-side knob set (the `[sampling]` config section and the
OpenAI body share it). `Sampler` turns one step's logits into one token id; it owns the
RNG and the token counts the penalties need, so one `Sampler` belongs to one sequence.
`StopMatcher` cuts the streamed text at the first stop string without ever emitting any
part of it, even when a stop string spans several token deltas. `TextStream` is the glue
from sampled ids to the text a caller may see: an mlx-lm streaming detokenizer (whole
UTF-8 characters only) feeding a `StopMatcher`, ending on EOS / stop ids / stop strings.

Order of operations (as in HF transformers and vLLM, so results are comparable with
the usual OpenAI-compatible servers): repetition penalty (prompt + generated), frequency
and presence penalties (generated only), then greedy argmax when temperature is 0, else
temperature, top-k, top-p, min-p and a categorical draw. Temperature comes before the
filters so that top-p/min-p act on the distribution that is actually sampled.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Iterable
from typing import Literal, Protocol

import mlx.core as mx
import msgspec

_NEG_INF = float("-inf")
_SEED_MOD = 2**64  # mx.random.key takes an unsigned 64-bit seed


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick tokens; defaults and ranges follow the OpenAI API.

    temperature 0 means greedy (argmax). top_k 0 means off. stop strings are cut from
    the output (never emitted); stop_token_ids end generation like EOS does.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or unset, got {self.max_tokens!r}")
        for s in self.stop:
            if not s:
                raise ValueError("stop must not contain an empty string")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    # `not (lo <= v <= hi)` also rejects NaN.
    if not (lo <= value <= hi):
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value!r}")


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

    def sample(self, logits: mx.array) -> int:
        """One token id from `logits` of shape [vocab] (or [1, vocab]); records it."""
        if logits.ndim == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.ndim != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(
                f"logits must have shape [{self.vocab_size}], got {list(logits.shape)}"
            )
        self._key, step_key = mx.random.split(self._key)
        x = self.process(logits.astype(mx.float32))
        if self.params.greedy:
            token = int(mx.argmax(x).item())
        else:
            token = int(mx.random.categorical(x, key=step_key).item())
        self.record(token)
        return token

    def process(self, logits: mx.array) -> mx.array:
        """Penalties, temperature and filters; returns float32 logits (-inf = excluded).

        Greedy stops after the penalties: temperature and filters cannot change argmax.
        """
        p = self.params
        x = self.apply_penalties(logits.astype(mx.float32))
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


class StopMatcher:
    """Streams text while cutting it at the first stop string.

    `feed(delta)` returns `(text_to_emit, stopped)`. Text that might be the start of a
    stop string is held back until the next delta decides it; `flush()` releases what is
    held when generation ends for another reason (EOS, length). Once stopped, everything
    after the stop string is dropped.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        for s in self.stops:
            if not s:
                raise ValueError("stop strings must not be empty")
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        hit = self._first_match(buf)
        if hit is not None:
            index, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[:index], True
        keep = self._holdback(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, for when generation ended without a stop string."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest


FinishReason = Literal["stop", "length"]


class Detokenizer(Protocol):
    """What `TextStream` needs: mlx-lm's `StreamingDetokenizer` (`TokenizerWrapper.detokenizer`)."""

    def add_token(self, token: int) -> object: ...

    def finalize(self) -> object: ...

    @property
    def last_segment(self) -> str: ...


class TextStream:
    """Sampled token ids -> text deltas that are safe to send to a client.

    `add(token)` returns `(delta, finish_reason)`: finish_reason is "stop" when the token is
    an EOS / stop token (the token itself produces no text, as in the OpenAI API) or the
    text reached a stop string (cut before it), else None. `finish()` ends a stream that
    ran out of tokens ("length") and returns the text still held back. `text` is all that
    was emitted so far.
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        stops: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._detok = detokenizer
        self._matcher = StopMatcher(stops)
        self._stop_ids = frozenset(stop_token_ids)
        self.text = ""
        self.finish_reason: FinishReason | None = None

    def add(self, token: int) -> tuple[str, FinishReason | None]:
        if self.finish_reason is not None:
            return "", self.finish_reason
        if token in self._stop_ids:
            return self._end("stop"), "stop"
        self._detok.add_token(token)
        out, stopped = self._matcher.feed(self._detok.last_segment)
        self.text += out
        if stopped:
            self.finish_reason = "stop"
        return out, self.finish_reason

    def finish(self, reason: FinishReason = "length") -> str:
        """End the stream (no-op if it already ended); returns the last text to emit."""
        if self.finish_reason is not None:
            return ""
        return self._end(reason)

    def _end(self, reason: FinishReason) -> str:
        self.finish_reason = reason
        self._detok.finalize()
        out, stopped = self._matcher.feed(self._detok.last_segment)
        if not stopped:
            out += self._matcher.flush()
        self.text += out
        return out
