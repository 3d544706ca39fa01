"""The run-ahead's lookups without extra kernels (actors/slot_map.py, pipeline/models/moe.py):
a layer's slots one gather from a bank-relative uint32 table, "every expert there" answered
on the host from the same table, and `gather_qmm`'s row indices made once per shape. Each
must leave the products bit-identical to mlx-lm's SwitchGLU."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from actors.pool.eviction import make_policy
from actors.pool.slots import SlotTable
from actors.slot_map import SlotMap, snapshot
from pipeline.models.moe import lhs_indices, routed_experts
from qpack.spec import ExpertFormat

E, H, INTER, K = 8, 64, 32, 2


def test_lookup_is_relative_to_each_layers_first_slot_and_absent_reads_slot_zero() -> None:
    host = np.full((2, E), -1, dtype=np.int32)
    host[0, [1, 3]] = [5, 2]
    host[1, [0, 7]] = [20, 17]
    table = SlotMap(host, {4: 0, 9: 1})
    firsts = {4: 0, 9: 16}
    ids = mx.array([[[3, 1, 6]]], dtype=mx.uint32)
    got = table.lookup(4, ids, firsts.__getitem__)
    assert got.dtype == mx.uint32
    assert got.tolist() == [[[2, 5, 0]]]
    assert table.lookup(9, mx.array([[[7, 0]]], dtype=mx.uint32), firsts.__getitem__).tolist() == [[[1, 4]]]
    present = table.present([4, 9], np.array([[[3, 1]], [[7, 0]]]))
    assert present.tolist() == [True, True]
    assert table.present([4, 9], np.array([[[3, 6]], [[7, 0]]])).tolist() == [False, True]
    assert table.present([9], np.array([[[7, 2]]])).tolist() == [False]


def test_a_snapshot_taken_while_the_table_moves_is_of_the_version_it_copied() -> None:
    """The MLX thread copies the table the event loop changes: an expert evicted and its
    slot given to one still loading, under the copy, must not leave a map that says the
    evicted one is ready there and is labelled as current (it would never be rebuilt)."""
    table = SlotTable(2, make_policy("lru"))
    for e in (0, 1):
        table.acquire((4, e), e, pin=False)
        table.mark_ready((4, e))
    real, moves = table.ready_items, []

    def moving() -> list[tuple[tuple[int, int], int]]:
        items = real()
        if not moves:  # the event loop's turn, once, between the copy and the label
            moves.append(table.acquire((4, 5), 9, pin=False))  # evicts expert 0: loading
        return items

    table.ready_items = moving  # type: ignore[method-assign]
    slot_map = snapshot(table, {4: 0}, 8)
    assert moves and slot_map.version == table.version
    evicted_slot = moves[0][0]
    assert table.key_at(evicted_slot) == (4, 5) and not table.ready((4, 5))
    want = [-1] * 8
    want[1] = table.lookup((4, 1))  # expert 0 gone, 5 not ready yet
    assert slot_map.host[0].tolist() == want

    def changing() -> list[tuple[tuple[int, int], int]]:
        if len(moves) < 3:
            moves.append(moves[0])
            raise RuntimeError("dictionary changed size during iteration")
        return real()

    table.ready_items = changing  # type: ignore[method-assign]
    assert snapshot(table, {4: 0}, 8).version == table.version and len(moves) == 3


def test_a_map_says_which_layers_experts_are_still_where_it_put_them() -> None:
    table = SlotTable(3, make_policy("lru"))
    for e in (0, 1, 2):
        table.acquire((4, e), e, pin=False)
        table.mark_ready((4, e))
    slot_map = snapshot(table, {4: 0}, 8)
    ids = np.array([[[0, 1]], [[2, 1]]])
    assert slot_map.held(table, [4, 4], ids).tolist() == [True, True]  # nothing moved
    table.acquire((4, 7), 9, pin=False)  # evicts expert 0 (LRU): its slot is 7's, loading
    assert slot_map.held(table, [4, 4], ids).tolist() == [False, True]
    # 7 evicted in turn, 0 back in its old slot: the same slot, other bytes meanwhile.
    for e in (1, 2):
        table.acquire((4, e), 10 + e, pin=False)  # touched: 7 is the least recently used
    table.mark_ready((4, 7))
    table.acquire((4, 0), 20, pin=False)
    table.mark_ready((4, 0))
    assert table.lookup((4, 0)) == slot_map.host[0, 0]
    assert slot_map.held(table, [4, 4], ids).tolist() == [False, True]


def test_row_indices_are_made_once_per_shape_as_mlx_would() -> None:
    a = lhs_indices((1, 1, 1, 1, H), (1, 1, K))
    assert a is lhs_indices((1, 1, 1, 1, H), (1, 1, K))
    assert a.dtype == mx.uint32 and a.tolist() == [[[0, 0]]]
    # down_proj's input has a row per slot
    assert lhs_indices((1, 1, K, 1, INTER), (1, 1, K)).tolist() == [[[0, 1]]]
    assert lhs_indices((3, 1, 1, 1, H), (3, 1, K)).tolist() == [[[0, 0]], [[1, 1]], [[2, 2]]]


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 5), (2, 40)], ids=["decode", "rows", "chunk", "sorted"])
def test_routed_experts_equal_mlx_lms_switch_glu_bit_for_bit(shape: tuple[int, int]) -> None:
    mx.random.seed(3)
    glu = SwitchGLU(H, INTER, E)
    nn.quantize(glu, group_size=32, bits=4)
    mx.eval(glu.parameters())
    x = mx.random.normal((*shape, H))
    ids = mx.random.randint(0, E, (*shape, K)).astype(mx.uint32)
    want = glu(x, ids)
    arrays = {f"{p}.{t}": getattr(getattr(glu, p), t) for p in ("gate_proj", "up_proj", "down_proj")
              for t in ("weight", "scales", "biases")}
    fmt = ExpertFormat(tensors=(), nbytes=0, bits=4, group_size=32)
    got = routed_experts(arrays, fmt, x, ids)
    assert mx.array_equal(got, want).item()
