"""Banks: a pool larger than the expert kernels index right is cut into slot ranges, each
layer's experts in its own (actors/pool/banks.py). The plan, the slot table keeping keys in
their bank, and the engine's logits bit-identical with and without banks."""

from __future__ import annotations

import mlx.core as mx
import msgspec
import pytest
from helpers_engine import engine_config
from helpers_forward import tiny_pair

from actors.pool.banks import INDEX_LIMIT, plan_banks, slot_limit
from actors.pool.eviction import make_policy
from actors.pool.layout import PoolLayout
from actors.pool.slots import SlotTable
from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.engine_sizing import PoolTooSmall
from pipeline.events import Done, TextDelta
from qpack.spec import ExpertFormat, TensorSpec

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]


def test_a_pool_within_the_limit_is_one_bank() -> None:
    assert plan_banks(606, list(range(40)), 2048) is None


@pytest.mark.parametrize("slots,layers,limit", [(10240, 40, 2048), (1000, 7, 300), (50, 3, 10)])
def test_banks_hold_whole_layers_within_the_limit(slots: int, layers: int, limit: int) -> None:
    banks = plan_banks(slots, list(range(layers)), limit)
    assert banks is not None
    assert all(0 < len(r) <= limit for r in banks.ranges)
    assert all(a.stop <= b.start for a, b in zip(banks.ranges, banks.ranges[1:], strict=False))
    assert sorted(banks.home) == list(range(layers))
    homes = [banks.home[layer] for layer in range(layers)]
    assert homes == sorted(homes) and set(homes) == set(range(len(banks)))  # contiguous groups
    assert banks.ranges[-1].stop <= slots
    assert all(banks.of_slot(s) == b for b, r in enumerate(banks.ranges) for s in (r.start, r.stop - 1))


def test_the_35b_pooled_whole_needs_banks_of_at_most_2048_slots() -> None:
    """4-bit [512, 2048] projections: 2^20 elements a slot; the signed bound is 2^31."""
    tensors = [TensorSpec(f"{p}.weight", "uint32", (512, 256) if p != "down_proj" else (2048, 64),
                          0, 512 * 1024) for p in ("gate_proj", "up_proj", "down_proj")]
    fmt = ExpertFormat(bits=4, group_size=64, nbytes=3 * 512 * 1024, tensors=tensors)
    assert slot_limit(PoolLayout.uniform(fmt)) == INDEX_LIMIT // 2**20 == 2048
    banks = plan_banks(10240, list(range(40)), 2048)
    assert banks is not None and len(banks) == 5 and {len(r) for r in banks.ranges} == {2048}


def test_keys_take_slots_and_victims_only_in_their_layers_bank() -> None:
    banks = plan_banks(12, [0, 1, 2], 4)
    assert banks is not None and len(banks) == 3
    table = SlotTable(12, make_policy("lru"), banks=banks)
    for tick in range(10):  # each layer churns through more experts than its bank holds
        for layer in range(3):
            slot, _ = table.acquire((layer, tick), tick, pin=False)
            assert slot in banks.of_layer(layer)
            table.mark_ready((layer, tick))
    assert all(table.lookup(k) in banks.of_layer(k[0]) for k in table.resident())  # type: ignore[operator]
    assert len(table) == 12 and table.layer_slots == 4
    taken = table.withdraw(3)  # one from each bank, from its top
    assert sorted(taken) == [3, 7, 11]
    assert table.restore(3) == [3, 7, 11]
    slot, _ = table.acquire((1, 99), 99, pin=False)
    assert slot == 7  # the freed slot of layer 1's bank, not another bank's
    # Under memory pressure every bank keeps what one layer pins, however much is asked.
    assert len(table.withdraw(12, keep=3)) == 3 and table.usable == 9
    assert all(sum(1 for s in r if s not in table._withdrawn) == 3 for r in banks.ranges)


def test_a_full_bank_drops_only_its_own_layers_predictions() -> None:
    """Layer 0's bank is all pinned: its predictions are dropped, layer 1's still go in."""
    from actors.pool.driver import PoolDriver

    banks = plan_banks(8, [0, 1], 4)
    assert banks is not None
    table = SlotTable(8, make_policy("lru"), banks=banks)
    driver = PoolDriver(table)
    driver.demand(0, [0, 1, 2, 3], tick=0)  # pins the whole of bank 0
    installed = driver.prefetch([(0, [4, 5]), (1, [6, 7])], tick=0)
    assert [key for key, _ in installed] == [(1, 6), (1, 7)]
    assert all(slot in banks.of_layer(1) for _, slot in installed)
    assert table.prefetch_dropped == 2


async def _greedy(qpack, **pool) -> tuple[list[int], list[dict[int, float]]]:
    config = engine_config(qpack, pool=pool, compute={"prefill_chunk": 16})
    async with open_engine(config) as engine:
        await engine.warm()
        ids: list[int] = []
        probs: list[dict[int, float]] = []
        async for event in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)):
            if isinstance(event, TextDelta):
                probs += [{e.token: e.logprob, **dict(e.top)} for e in event.logprobs]
            elif isinstance(event, Done):
                ids = list(event.token_ids)
        table = engine._core.router.table
        banks = table.banks
        if pool.get("bank_slots"):
            assert banks is not None and len(banks) > 1
            assert engine.pool_snapshot()["pool_banks"] == len(banks)
            storage = engine._core.storage
            for layer, expert in table.resident():
                slot = table.lookup((layer, expert))
                assert slot in banks.of_layer(layer)
                arrays, _fmt, first = storage.view(layer)
                assert first == banks.of_layer(layer).start
                for name, rows in arrays.items():  # the bank's slice: row slot - first
                    assert rows.shape[0] == len(banks.of_layer(layer))
                    whole = storage.arrays[storage.layout.layer(layer)[1][name]]
                    assert mx.array_equal(rows[slot - first], whole[slot]).item()
        else:
            assert banks is None and engine.pool_snapshot()["pool_banks"] == 1
        return ids, probs


async def test_logits_bit_identical_with_the_pool_in_banks(synth_checkpoint, packed, info_logs) -> None:
    """Every expert pooled, in one array and in banks of 40 slots (several layers each,
    views at an offset): the same greedy tokens and log-probabilities, exactly."""
    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next", 4)
    whole = await _greedy(qpack, slots=1 << 12)
    banked = await _greedy(qpack, slots=1 << 12, bank_slots=40)
    assert banked == whole


async def test_a_bank_too_small_for_a_layer_is_refused_in_one_line(synth_checkpoint, packed) -> None:
    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next", 4)
    with pytest.raises(PoolTooSmall, match=r"pool.bank_slots: a bank of \d+ slots cannot hold"):
        async with open_engine(engine_config(qpack, pool={"slots": 64, "bank_slots": 6},
                                             compute={"prefill_chunk": 2})):
            pass



async def test_the_trace_records_the_bank_limit_a_replay_cuts_banks_by(synth_checkpoint, packed) -> None:
    """tests/test_replay_live.py replays a banked live run exactly; here, what it replays from."""
    from pipeline.replay import simulate

    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next", 4)
    config = engine_config(qpack, pool={"slots": 40, "bank_slots": 20})
    async with open_engine(config, record_routing=True) as engine:
        async for _ in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8)):
            pass
        trace = engine.routing_trace()
        live = engine._core.router.table.snapshot()
    assert trace.model.bank_limit == 20
    assert simulate(trace, "reuse", {}, "recorded", num_slots=40).pool == live
    one_bank = msgspec.structs.replace(trace, model=msgspec.structs.replace(trace.model, bank_limit=0))
    assert simulate(one_bank, "reuse", {}, "recorded", num_slots=40).pool != live
