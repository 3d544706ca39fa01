"""`Counters`: a frozen snapshot of the engine's counters; subtracting two gives what
happened between them, field by field."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.counters import Counters


def _at(**values: float) -> Counters:
    zero = {f.name: 0 for f in msgspec.structs.fields(Counters)}
    return Counters(**(zero | values))


def test_a_difference_is_field_by_field() -> None:
    before = _at(t=10.0, hits=3, misses=1, bytes_read=100, predicted=4, correct=1, actual=8)
    after = _at(t=12.5, hits=9, misses=3, bytes_read=700, predicted=10, correct=4, actual=16,
                disk_busy_seconds=2.0, disk_in_flight_seconds=5.0)
    spent = after - before
    assert (spent.t, spent.hits, spent.misses, spent.bytes_read) == (2.5, 6, 2, 600)
    assert spent.hit_rate == 0.75
    assert (spent.precision, spent.recall) == (0.5, 3 / 8)
    assert spent.disk_busy_fraction == pytest.approx(0.8)
    assert spent.mean_in_flight == pytest.approx(2.0)
    assert _at().hit_rate == 0.0 and _at().precision == 0.0


def test_a_snapshot_cannot_be_changed() -> None:
    with pytest.raises(AttributeError):
        _at().hits = 1  # type: ignore[misc]
