"""The literature's policies: frequency-weighted LRU, reuse distance, pinning hot experts."""

from __future__ import annotations

import pytest

from actors.pool.eviction import make_policy
from actors.pool.eviction_scored import FreqLRU, PinHot, ReuseDistance
from actors.pool.slots import SlotTable


def _always(key: tuple[int, int]) -> bool:
    return True


def test_flru_trades_ten_tokens_of_recency_for_one_use() -> None:
    p = FreqLRU(weight=10.0)
    # one layer: one tick per token
    p.insert((0, 1), 0)
    for t in (1, 2, 3):
        p.touch((0, 1), t)  # 4 uses, last at token 3: score 43
    p.insert((0, 2), 30)  # 1 use at token 30: score 40
    assert p.victim(_always) == (0, 2)
    p.remove((0, 2))
    p.insert((0, 3), 40)  # score 50: now key 1 (43) is the lowest
    assert p.victim(_always) == (0, 1)
    assert p.victim(lambda k: k != (0, 1)) == (0, 3)
    p.remove((0, 1))
    p.insert((0, 1), 41)  # uses start again after an eviction: 51
    assert p.victim(_always) == (0, 3)


def test_flru_counts_time_in_tokens_not_ticks() -> None:
    p = FreqLRU(weight=10.0)
    # four layers: ticks 0..3 are token 0, ticks 36..39 are token 9
    for layer in range(4):
        p.insert((layer, 0), layer)
    p.touch((0, 0), 4)  # key (0, 0): 2 uses, token 1 -> 21
    p.insert((1, 5), 39)  # 1 use at token 9.75 -> 19.75: lower, so it goes first
    assert p.victim(lambda k: k[1] != 0 or k == (0, 0)) == (1, 5)


def test_reuse_distance_keeps_a_regular_key_over_a_recent_one_off() -> None:
    p = ReuseDistance()
    for t in (0, 2, 4, 6, 8):
        p.touch((0, 1), t) if (0, 1) in p else p.insert((0, 1), t)  # gap 2
    p.insert((0, 2), 1)
    p.touch((0, 2), 9)  # gap 8, used last
    p.insert((0, 3), 9)  # never reused: takes the mean gap
    # now 9: key 1 stale 1 gap 2 -> 2; key 2 stale 0 gap 8 -> 8; key 3 prior (8+2*4)/5=3.2
    assert p.victim(_always) == (0, 2)
    assert p.victim(lambda k: k != (0, 2)) == (0, 3)
    p.insert((0, 4), 30)  # now 30: key 1 is 22 tokens overdue, the stalest
    assert p.victim(_always) == (0, 1)


def test_pin_keeps_the_most_used_keys_whatever_their_recency() -> None:
    p = PinHot(fraction=0.5)
    p.set_capacity(4)  # hot set: the 2 most used keys
    for t, e in enumerate([1, 1, 1, 2, 2, 3, 4]):
        p.touch((0, e), t) if (0, e) in p else p.insert((0, e), t)
    # LRU order 1, 2, 3, 4; 1 and 2 are hot, so 3 goes first
    assert p.victim(_always) == (0, 3)
    p.remove((0, 3))
    for t in (8, 9, 10):
        p.touch((0, 4), t)  # 4 uses: 4 becomes hot, 2 (2 uses) drops out
    assert p.victim(_always) == (0, 2)
    assert p.victim(lambda k: k[1] in (1, 4)) == (0, 1)  # only hot ones left: their LRU


@pytest.mark.parametrize("name", ["flru", "reuse", "pin"])
def test_scored_policies_run_a_pool(name: str) -> None:
    t = SlotTable(6, make_policy(name))
    for tick in range(200):
        for layer in range(2):
            key = (layer, (tick * 7 + layer) % 5 if tick % 3 else tick % 11)
            t.acquire(key, tick * 2 + layer, pin=False)
    c = t.snapshot()
    assert c.hits + c.misses == 400 and len(t) == 6 and c.evictions == c.misses - 6
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy(name, decay=0.5)


def test_lazy_heap_victims_equal_a_full_scan_while_pins_come_and_go() -> None:
    """Entries set aside while pinned return once they may go: every victim is still the
    lowest current entry the caller allows (what the policies' replays depend on)."""
    import random

    from actors.pool.heap_scan import LazyHeap

    rng = random.Random(7)
    heap, live, prio = LazyHeap(), {}, {}
    seq = 0
    for _ in range(3000):
        key = (rng.randrange(4), rng.randrange(16))
        if rng.random() < 0.15 and key in live:
            del live[key]  # removed: its entries are stale
            continue
        seq += 1
        live[key], prio[key] = seq, rng.random()
        heap.push((prio[key], seq, key), live)
        pinned = set(rng.sample(sorted(live), min(len(live), rng.randrange(6))))
        for _ in range(rng.randrange(1, 4)):  # a placement asks several times, pins held

            def allowed(k: tuple[int, int], pinned: set[tuple[int, int]] = pinned) -> bool:
                return k not in pinned

            want = min(((prio[k], live[k], k) for k in live if allowed(k)), default=None)
            assert heap.victim(live, allowed) == (None if want is None else want[2])
        assert len(heap) <= 4 * len(live) + 65
