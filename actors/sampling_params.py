"""`SamplingParams`: how to pick tokens, as the `[sampling]` config section and the OpenAI
body both say it. Plain data with its range checks; no MLX, so configs and the CLI load fast.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

# How a request may decode (actors/speculative/): the one list of the modes.
SPECULATIVE_MODES = ("auto", "mtp", "ngram", "off")
# The knobs that shape the distribution: each one number, and each said the same way by a
# model's generation_config.json, a `[sampling]` key, an OpenAI request field and an Ollama
# option (`repeat_penalty` there). Declared here once; the config, the generation config,
# the server's requests and the Ollama options read this tuple (tests/test_sampling_knobs.py
# holds their fields to it).
SCALAR_KNOBS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                 "frequency_penalty", "repetition_penalty")


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
    # (token id, bias) pairs added to the logits before anything else samples (OpenAI).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no log-probabilities; k >= 0: the chosen token's and the k most likely ones'.
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's log-probability given the tokens before it,
    # and the k most likely there (`echo` with `logprobs` on /v1/completions). The prompt
    # is then computed in full (no prefix-cache reuse): every position needs its logits.
    prompt_logprobs: int | None = None
    # Per request, set by the server, never by a config file: an `actors.sampler.TokenConstraint`
    # (a grammar's token masks). A field here so that it reaches the sampler with the other
    # knobs; typed Any because msgspec cannot decode a protocol.
    constraint: Any = None
    # Speculative decoding for this request ("auto", "mtp", "ngram", "off"); None: the
    # engine's `compute.speculative`. Changes speed, never the tokens.
    speculative: str | None = None

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
        # 0 only to score a prompt (echo with logprobs: lm-eval-harness's loglikelihood).
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and self.max_tokens < least:
            raise ValueError(f"max_tokens must be >= 1 or unset (0 only with prompt logprobs), "
                             f"got {self.max_tokens!r}")
        for s in self.stop:
            if not s:
                raise ValueError("stop must not contain an empty string")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t!r}")
        for t, bias in self.logit_bias:
            if t < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {t!r}")
            _check_range("logit_bias", bias, -100.0, 100.0)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20] or unset, got {self.prompt_logprobs!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20] or unset, got {self.logprobs!r}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                             f"got {self.speculative!r}")
        if self.constraint is not None and not callable(getattr(self.constraint, "allowed", None)):
            raise ValueError("constraint is a grammar object the server sets per request; "
                             "it cannot come from a config file")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab: int) -> None:
        """Refuse token ids the model does not have. A `logit_bias` id reaches MLX as an
        index: one at or past the vocabulary wrote out of bounds (heap corruption, a
        segfault), so every path to a sampler calls this first (`Generation.check`)."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    # `not (lo <= v <= hi)` also rejects NaN.
    if not (lo <= value <= hi):
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value!r}")
