"""`TokenLogprob`: one sampled token's log-probability and the most likely alternatives.

Plain data (no MLX), so that events and the server's wire format can carry it without
importing the sampler.
"""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first
