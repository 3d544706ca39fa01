"""The cache operations of a regroup, on mlx-lm's real caches (one KV layer, one
Gated DeltaNet state layer per sequence): every combination of leavers and newcomers
ends with each remaining row's own state, in order."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from actors.batch_regroup import regroup_caches
from pipeline.models.batch_caches import BatchCaches


def _sequence(tag: float, length: int) -> list[object]:
    """A prefilled sequence's caches: its keys/values and DeltaNet state carry `tag`."""
    kv = KVCache()
    kv.update_and_fetch(mx.full((1, 2, length, 4), tag), mx.full((1, 2, length, 4), -tag))
    state = ArraysCache(2)
    state[0], state[1] = mx.full((1, 3, 5), tag), mx.full((1, 2, 4, 4), tag)
    return [kv, state]


def _tags(caches: list[object]) -> list[float]:
    """Each row's tag, read from the DeltaNet state (rows in order)."""
    state = caches[1]
    assert isinstance(state, ArraysCache)
    return [float(v) for v in state[0][:, 0, 0].tolist()]


@pytest.mark.parametrize(("rows", "keep", "joining"), [
    (2, [], 1),  # every row leaves while a newcomer joins (was an IndexError)
    (3, [], 2),
    (2, [1], 1),
    (3, [0, 2], 1),
    (2, [], 0),
    (1, [], 1),
    (1, [0], 1),
])
def test_a_regroup_keeps_each_remaining_rows_own_state(rows: int, keep: list[int],
                                                        joining: int) -> None:
    ops = BatchCaches()
    olds = [_sequence(1.0 + i, 3 + i) for i in range(rows)]
    batch = ops.merge(olds) if rows > 1 else olds[0]
    news = [_sequence(10.0 + j, 2) for j in range(joining)]
    out, taken = regroup_caches(ops, batch, rows, keep, news, copies=[i for i in range(rows)
                                                                       if i not in keep])
    want = [1.0 + i for i in keep] + [10.0 + j for j in range(joining)]
    if not want:
        assert out is None
    else:
        assert out is not None and _tags(out) == want
    if rows > 1:  # the leavers' own caches were copied out, whole
        for i in range(rows):
            if i not in keep:
                assert _tags(taken[i]) == [1.0 + i]
