"""MLX values read back as the Python types they are.

MLX's stubs type `array.tolist()` as any nesting of scalars and `array.item()` as int,
float or complex, whatever the array; the array's shape and dtype say which it is. These
say it once, so the callers stay typed (one cast each, here, instead of one per caller).
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx


def to_int(a: mx.array) -> int:
    """A one-element integer array's value."""
    return int(cast(int, a.item()))


def to_float(a: mx.array) -> float:
    return float(cast(float, a.item()))


def int_list(a: mx.array) -> list[int]:
    """A 1-D integer array as a list."""
    return cast(list[int], a.tolist())


def float_list(a: mx.array) -> list[float]:
    return cast(list[float], a.tolist())


def int_rows(a: mx.array) -> list[list[int]]:
    """A 2-D integer array as a list of rows."""
    return cast(list[list[int]], a.tolist())


def float_rows(a: mx.array) -> list[list[float]]:
    return cast(list[list[float]], a.tolist())
