"""What a generation yields: text deltas, then one `Done` carrying the run's stats."""

from __future__ import annotations

from typing import Literal

import msgspec

from actors.token_logprob import TokenLogprob

FinishReason = Literal["stop", "length"]


class TextDelta(msgspec.Struct, frozen=True, tag="delta"):
    text: str
    token_ids: tuple[int, ...]
    # With `SamplingParams.logprobs`: every token sampled since the previous delta (a token
    # whose text is held back, e.g. half a character, comes with the next delta).
    logprobs: tuple[TokenLogprob, ...] = ()
    # With `SamplingParams.prompt_logprobs`, on the first delta only (an empty one sent
    # right after the prompt): one entry per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class GenerationStats(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    hit_rate: float
    hits: int
    misses: int
    reads: int
    bytes_read: int
    bytes_read_per_token: float
    stall_s: float
    stall_fraction: float  # of the decode time, compute spent waiting on reads
    prefetch_precision: float
    prefetch_recall: float
    prefetch_wasted_bytes: int
    prefetch_used: int
    # Estimate: demanded experts a prefetch had already loaded x the mean read time.
    prefetch_saved_s: float
    peak_rss_mb: float  # the process's high-water mark, loading included
    peak_device_mb: float
    seed: int
    # While decoding: the largest RSS after a decode step, and MLX's device peak.
    decode_rss_mb: float = 0.0
    decode_device_mb: float = 0.0
    # Speculative decoding (docs/speculative.md): the mode it ran with ("off": none),
    # verify passes, drafted tokens verified and kept, and tokens per pass.
    speculative: str = "off"
    verify_passes: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    tokens_per_pass: float = 0.0


class Done(msgspec.Struct, frozen=True, tag="done"):
    finish_reason: FinishReason
    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats


Event = TextDelta | Done
