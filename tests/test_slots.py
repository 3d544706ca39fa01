"""Eviction policies and the slot table: victims, counters, and invariants under random use."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.pool.driver import PoolDriver
from actors.pool.eviction import LRU, POLICY_NAMES, SLRU, LFUDecay, make_policy
from actors.pool.slots import PoolExhausted, SlotTable


def always(_key: tuple[int, int]) -> bool:
    return True


# -- policies ------------------------------------------------------------------------------


def test_lru_victim_is_least_recent_and_respects_evictable() -> None:
    p = LRU()
    for e in range(4):
        p.insert((0, e), e)
    p.touch((0, 0), 5)
    assert p.victim(always) == (0, 1)
    assert p.victim(lambda k: k != (0, 1)) == (0, 2)
    assert p.victim(lambda k: False) is None
    p.remove((0, 1))
    assert p.victim(always) == (0, 2)
    with pytest.raises(KeyError, match=r"\(0, 1\)"):
        p.remove((0, 1))


def test_lfu_keeps_frequent_key_and_breaks_ties_by_recency() -> None:
    p = LFUDecay(decay=1.0)
    p.insert((0, 0), 0)
    for t in range(1, 5):
        p.touch((0, 0), t)
    p.insert((0, 1), 5)
    p.insert((0, 2), 6)
    # (0,1) and (0,2) have count 1; (0,1) was used less recently.
    assert p.victim(always) == (0, 1)
    assert p.victim(lambda k: k != (0, 1)) == (0, 2)
    assert p.victim(lambda k: k == (0, 0)) == (0, 0)


def test_lfu_old_popularity_fades() -> None:
    p = LFUDecay(decay=0.5, period=10)
    p.insert((0, 0), 0)
    for _ in range(7):
        p.touch((0, 0), 0)  # count 8 at tick 0
    p.insert((0, 1), 0)
    p.touch((0, 1), 0)  # count 2 at tick 0
    assert p.victim(always) == (0, 1)
    p.touch((0, 1), 50)  # 8 * 0.5**5 = 0.25 vs 2 * 0.5**5 + 1
    assert p.victim(always) == (0, 0)
    assert p.frequency((0, 0), 50) == pytest.approx(0.25)


def test_lfu_a_key_touched_on_the_tick_that_renormalises_is_rescaled_too() -> None:
    """Its old score was read before the rescale and added to the new weight: e^200 too
    large, never evicted for a whole period (defaults: after ~970k ticks of a server)."""
    p = LFUDecay(decay=0.5, period=1)  # the exponent passes 200 at tick 289
    a, b = (0, 1), (0, 2)
    p.insert(a, 0)
    p.insert(b, 0)
    for tick in range(1, 289):
        p.touch(a, tick)  # used every tick
    p.touch(b, 287)
    p.touch(b, 289)  # on the tick that renormalises
    p.touch(a, 290)
    assert p.frequency(b, 290) < p.frequency(a, 290) < 3
    assert p.victim(lambda k: True) == b


def test_lfu_matches_brute_force_decayed_counts_across_renormalisation() -> None:
    rng = random.Random(7)
    decay, period = 0.7, 3  # fast growth: forces several renormalisations
    p = LFUDecay(decay=decay, period=period)
    history: dict[tuple[int, int], list[int]] = {}
    last: dict[tuple[int, int], int] = {}
    op = 0
    tick = 0
    for _ in range(3000):
        tick += rng.choice([0, 1, 1, 2, 7])
        key = (0, rng.randrange(40))
        op += 1
        if key in history and rng.random() < 0.1:
            p.remove(key)
            del history[key], last[key]
            continue
        if key in history:
            p.touch(key, tick)
        else:
            p.insert(key, tick)
        history.setdefault(key, []).append(tick)
        last[key] = op
        if op % 50 == 0:
            pinned = set(rng.sample(sorted(history), k=min(3, len(history))))

            def score(k: tuple[int, int], now: int = tick) -> float:
                return sum(decay ** ((now - t) / period) for t in history[k])

            candidates = [k for k in history if k not in pinned]
            got = p.victim(lambda k, pinned=pinned: k not in pinned)
            assert got is not None
            best = min(score(k) for k in candidates)
            assert math.isclose(score(got), best, rel_tol=1e-9)
            tied = [k for k in candidates if math.isclose(score(k), best, rel_tol=1e-9)]
            assert got == min(tied, key=lambda k: last[k])
    assert tick / period * -math.log(decay) > 2 * LFUDecay._MAX_EXPONENT


def test_slru_resists_a_scan_of_one_shot_keys() -> None:
    p = SLRU(protected_fraction=0.5)
    table = SlotTable(4, p)
    hot = [(0, 100), (0, 101)]
    for t, k in enumerate(hot * 2):
        table.acquire(k, t, pin=False)
    for t in range(10, 40):
        table.acquire((0, t), t, pin=False)  # one-shot scan
    assert all(k in table for k in hot)
    lru = SlotTable(4, LRU())
    for t, k in enumerate(hot * 2):
        lru.acquire(k, t, pin=False)
    for t in range(10, 40):
        lru.acquire((0, t), t, pin=False)
    assert not any(k in lru for k in hot)


def test_make_policy_registry() -> None:
    assert isinstance(make_policy("lfu", decay=0.5, period=4), LFUDecay)
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy("slru"), SLRU)
    with pytest.raises(ValueError, match="'mru'.*lfu, lru, slru"):
        make_policy("mru")
    with pytest.raises(ValueError, match="'lru'.*bad parameters"):
        make_policy("lru", decay=0.5)
    with pytest.raises(ValueError, match="decay"):
        make_policy("lfu", decay=1.5)


# -- slot table ----------------------------------------------------------------------------


def test_acquire_counts_hits_misses_and_reuses_slots() -> None:
    t = SlotTable(2, LRU())
    assert t.acquire((0, 1), 0, pin=False) == (0, False)
    assert t.acquire((0, 2), 0, pin=False) == (1, False)
    assert t.acquire((0, 1), 1, pin=False) == (0, True)
    assert t.state((0, 1)) == "loading" and not t.ready((0, 1))
    t.mark_ready((0, 1))
    assert t.state((0, 1)) == "ready" and t.ready((0, 1))
    slot, resident = t.acquire((0, 3), 2, pin=False)  # evicts (0,2), the LRU key
    assert (slot, resident) == (1, False)
    assert t.lookup((0, 2)) is None and t.lookup((0, 3)) == 1
    assert not t.ready((0, 2))  # not resident: not ready (no error)
    s = t.snapshot()
    assert (s.hits, s.misses, s.evictions, s.resident) == (1, 3, 1, 2)
    assert s.hit_rate == pytest.approx(0.25)


def test_a_table_holding_every_key_teaches_its_policy_only_once_slots_are_withdrawn() -> None:
    """With every key of the model fitting, nothing is ever evicted: hits skip the policy's
    bookkeeping (most of a token's host work with every expert pooled). Once memory
    pressure withdraws slots below the key count, the policy learns from hits again."""
    touched: list[tuple[int, int]] = []

    class Recording(LRU):
        def touch(self, key: tuple[int, int], tick: int) -> None:
            touched.append(key)
            super().touch(key, tick)

    t = SlotTable(4, Recording(), keys=4)
    for e in range(4):
        t.acquire((0, e), 0, pin=False)
        t.mark_ready((0, e))
    assert [t.acquire((0, e), 1, pin=True) for e in range(4)] == [(e, True) for e in range(4)]
    assert touched == [] and t.snapshot().hits == 4
    for e in range(4):
        t.unpin((0, e))
    assert t.withdraw(1) == [3]  # 3 usable slots for 4 keys: evictions can happen now
    t.acquire((0, 0), 2, pin=False)
    assert touched == [(0, 0)]
    unknown = SlotTable(4, Recording())  # the key count unknown: every hit teaches
    unknown.acquire((1, 0), 0, pin=False)
    unknown.acquire((1, 0), 1, pin=False)
    assert touched == [(0, 0), (1, 0)]


def test_pins_are_refcounted_and_block_eviction() -> None:
    t = SlotTable(2, LRU())
    t.acquire((0, 1), 0, pin=True)
    t.acquire((0, 2), 0, pin=True)
    t.pin((0, 1))
    with pytest.raises(PoolExhausted, match="2 of 2 slots pinned"):
        t.acquire((0, 3), 1, pin=True)
    t.unpin((0, 1))
    with pytest.raises(PoolExhausted):
        t.acquire((0, 3), 1, pin=True)  # (0,1) still holds one pin
    t.unpin((0, 1))
    assert t.acquire((0, 3), 1, pin=False) == (0, False)
    with pytest.raises(KeyError, match=r"\(0, 1\).*not pinned"):
        t.unpin((0, 1))
    with pytest.raises(KeyError, match="not resident"):
        t.pin((5, 5))


def test_release_frees_the_slot_of_a_failed_load() -> None:
    t = SlotTable(2, LFUDecay())
    t.acquire((0, 1), 0, pin=True)
    t.acquire((0, 2), 0, pin=True)
    t.release((0, 1))
    assert (0, 1) not in t and t.pinned == 1
    assert t.acquire((0, 4), 1, pin=True) == (0, False)
    assert t.snapshot().evictions == 0


def test_prefetch_used_wasted_and_dropped() -> None:
    t = SlotTable(3, LRU())
    d = PoolDriver(t)
    d.demand(0, [0], tick=0)
    installed = d.prefetch([(1, [5, 6]), (2, [7, 8])], tick=0)
    # 3 slots: (0,0) pinned, (1,5),(1,6) installed; (2,7) would evict this step's own install.
    assert installed == [((1, 5), 1), ((1, 6), 2)]
    assert t.prefetch_dropped == 2
    d.demand(1, [5], tick=1)  # prefetched, now demanded: a hit and a used prefetch
    d.prefetch([(2, [9])], tick=1)  # evicts (0,0) (unpinned, LRU)
    d.demand(2, [1], tick=2)  # miss: evicts (1,6), a prefetch never demanded
    s = t.snapshot()
    assert (s.hits, s.misses) == (1, 2)
    assert (s.prefetch_installs, s.prefetch_used, s.prefetch_wasted) == (3, 1, 1)


def test_a_demand_never_evicts_one_of_its_own_chosen_experts() -> None:
    t = SlotTable(3, LRU())
    d = PoolDriver(t)
    d.prefetch([(1, [5, 6, 7])], tick=0)  # (1,5) is the least recent
    evicted: list[tuple[int, int]] = []
    t.on_evict = evicted.append
    # The miss (1,9) comes first: its slot is (1,7)'s, not (1,5)'s or (1,6)'s, which the
    # same demand needs next (each would be read again).
    d.demand(1, [9, 5, 6], tick=1)
    assert evicted == [(1, 7)]
    assert (t.hits, t.misses) == (2, 1)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["acq", "acq_pin", "pin", "unpin", "release", "ready", "prefetch"]),
        st.integers(0, 2),
        st.integers(0, 7),
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(list(POLICY_NAMES)), slots=st.integers(1, 6), ops=OPS)
def test_table_invariants_under_random_operations(policy: str, slots: int, ops: list) -> None:
    t = SlotTable(slots, make_policy(policy, **({"period": 3} if policy == "lfu" else {})))
    pins: dict[tuple[int, int], int] = {}
    for tick, (op, layer, expert) in enumerate(ops):
        key = (layer, expert)
        pinned_before = {k for k, c in pins.items() if c > 0}
        if op in ("acq", "acq_pin"):
            try:
                t.acquire(key, tick, pin=op == "acq_pin")
            except PoolExhausted:
                assert key not in t and len(pinned_before) == slots
            else:
                if op == "acq_pin":
                    pins[key] = pins.get(key, 0) + 1
        elif op == "prefetch":
            t.try_prefetch(key, tick)
        elif key not in t:
            continue
        elif op == "pin":
            t.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key, 0) > 0:
            t.unpin(key)
            pins[key] -= 1
        elif op == "release":
            t.release(key)
            pins.pop(key, None)
        elif op == "ready":
            t.mark_ready(key)
        resident = t.resident()
        assert len(resident) <= slots
        assert pinned_before <= set(resident) | {k for k in pinned_before if op == "release"}
        slot_of = {k: t.lookup(k) for k in resident}
        assert len(set(slot_of.values())) == len(slot_of)  # injective
        assert all(0 <= s < slots and t.key_at(s) == k for k, s in slot_of.items())
        used = {s for s in range(slots) if t.key_at(s) is not None}
        assert used == set(slot_of.values())  # onto the used slots
        assert all(t.pin_count(k) == c for k, c in pins.items() if k in t)
        assert len(t.policy) == len(resident)


@pytest.mark.parametrize("policy", ["reuse", "flru", "lfu"])
def test_a_kept_eviction_predicate_chooses_the_victims_a_fresh_one_would(policy: str) -> None:
    """`_take_slot` keeps its predicate while it can only grow stricter, and the heaps skip
    what it refused before: the same evictions as a predicate made anew for every victim."""
    import random

    from actors.pool.driver import PoolDriver
    from actors.pool.eviction import make_policy

    class Fresh(SlotTable):
        def _take_slot(self, protect, bank):  # type: ignore[no-untyped-def]
            self._evictable = None
            return super()._take_slot(protect, bank)

    def run(cls: type[SlotTable]) -> list[tuple[int, int]]:
        rng = random.Random(3)
        table = cls(40, make_policy(policy), keys=12 * 48)
        evicted: list[tuple[int, int]] = []
        table.on_evict = evicted.append
        driver = PoolDriver(table)
        tick = 0
        for _ in range(60):
            for layer in range(12):
                tick += 1
                driver.demand(layer, rng.sample(range(48), 4), tick)
                driver.prefetch([((layer + 1) % 12, rng.sample(range(48), 5)),
                                 ((layer + 2) % 12, rng.sample(range(48), 2))], tick)
        return evicted

    kept = run(SlotTable)
    assert len(kept) > 1000 and kept == run(Fresh)


def test_a_key_unpinned_between_two_victims_of_one_protect_set_can_go() -> None:
    table = SlotTable(3, make_policy("flru"))
    protect: set[tuple[int, int]] = set()
    table.acquire((0, 0), 1, pin=True)  # the oldest, one use: the lowest score, but pinned
    table.acquire((0, 1), 2, pin=False)
    table.acquire((0, 2), 3, pin=False)
    evicted: list[tuple[int, int]] = []
    table.on_evict = evicted.append
    table.acquire((0, 3), 4, pin=False, prefetch=True, protect=protect)
    protect.add((0, 3))
    table.unpin((0, 0))  # the same protect set next, but a pin went: (0, 0) may go now
    table.acquire((0, 4), 5, pin=False, prefetch=True, protect=protect)
    assert evicted == [(0, 1), (0, 0)]
