"""Argument types for counts that no config key checks: each flag's range, said where the
flag is declared (argparse then refuses a value outside it, exit 2, before any work).
Flags that set config keys (`--pool-mb`, `--prefill-chunk`, ...) get their ranges from
the config schema instead."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {value}")
        return value

    return parse


def seconds(hi: float) -> Callable[[str], float]:
    """A number of seconds in (0, hi]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds in (0, {hi:g}], got {text!r}") from None
        if not 0 < value <= hi:  # NaN fails too
            raise argparse.ArgumentTypeError(f"expected seconds in (0, {hi:g}], got {text}")
        return value

    return parse


TOKENS = count(1, 1 << 16)  # prompt or generated tokens of a benchmark run
SLOTS = count(1, 1 << 24)  # as pool.slots
LAYERS = count(1, 1024)
ROUNDS = count(1, 100)  # `bench --rounds`: the case list run this many times
WORKERS = count(1, 256)
