"""When a decode token should run ahead: one host sync for the whole token.

Running ahead pays off when every expert the token routes to is already in the pool (the
GPU then never waits for the host between layers); a token that misses costs the
run-ahead's wasted layers plus the per-layer fallback. So: try it after a token that
needed no read, and after a run-ahead miss step layer by layer for `cooldown` tokens
(misses come in bursts: a new topic, a cold pool) before trying again.

Modes: "auto" (the above), "on" (every decode token tries first: tests force misses
with it), "off" (always one sync per MoE layer).
"""

from __future__ import annotations

from typing import Literal

RunAheadMode = Literal["auto", "on", "off"]


class RunAheadPolicy:
    def __init__(self, mode: RunAheadMode = "auto", cooldown: int = 4) -> None:
        self.mode = mode
        self.cooldown = cooldown
        self._wait = 0
        self._last_hit = True  # optimistic: a miss costs one wasted pass, then a cooldown

    def ready(self) -> bool:
        """Whether the next token should run ahead."""
        return self.mode == "on" or (self.mode == "auto" and self._last_hit and self._wait == 0)

    def wanted(self) -> bool:
        """`ready`, for a decode token about to be computed: counts down the cooldown."""
        want = self.ready()
        if self._wait:
            self._wait -= 1
        return want

    def after_run_ahead(self, hit: bool) -> None:
        self._last_hit = hit
        if not hit:
            self._wait = self.cooldown

    def after_layered(self, hit: bool) -> None:
        self._last_hit = hit
