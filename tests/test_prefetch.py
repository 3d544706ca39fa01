"""Prefetch strategies (statistical and gate-based) and the prediction scorer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from actors.prefetch import (
    Combined,
    History,
    NoPrefetch,
    PrefetchScorer,
    PrefetchStrategy,
    Transition,
    make_strategy,
)
from actors.prefetch.gate import NextGate
from actors.prefetch.strategies import LayerOrder

MOE = [0, 2, 3, 5]  # not every layer is MoE: strategies must skip the gaps


def test_layer_order_skips_non_moe_layers() -> None:
    order = LayerOrder(MOE)
    assert order.after(0, 1) == [2]
    assert order.after(1, 2) == [2, 3]
    assert order.after(3, 5) == [5]
    assert order.after(5, 1) == []
    assert order.previous(5) == 3 and order.previous(0) is None


def test_history_predicts_recent_popularity() -> None:
    h = History(moe_layers=MOE, num_experts=8, top_k=2, decay=0.9)
    assert h.predict(0, [1], None) == []  # nothing seen yet: no guesses
    for _ in range(4):
        h.observe(2, [6, 7])
    h.observe(2, [1, 7])
    # 7: highest; 6 (decayed 4 hits) still beats 1 (one recent hit)
    assert h.predict(0, [1], None) == [(2, [7, 6])]
    for _ in range(3):
        h.observe(2, [1, 7])
    assert h.predict(0, [1], None) == [(2, [7, 1])]


def test_transition_learns_layer_to_layer_mapping() -> None:
    tr = Transition(moe_layers=MOE, num_experts=8, top_k=2)
    for _ in range(3):
        tr.reset_sequence()
        for layer in MOE:
            tr.observe(layer, [1, 2] if layer == 0 else [3, 4] if layer == 2 else [5, 6])
    assert tr.predict(0, [1, 2], None) == [(2, [3, 4])]
    assert tr.predict(2, [3], None) == [(3, [5, 6])]
    assert tr.predict(5, [5], None) == []  # last MoE layer: nothing later in the token
    assert tr.predict(0, [7], None) == []  # expert 7 never seen at layer 0


def test_transition_pairs_each_token_of_a_multi_row_step_with_itself() -> None:
    """A prefill chunk (or a batch, a verify pass) is observed row by row per layer: token
    i's row at layer 0 leads to token i's at layer 2 (it paired the last with the first)."""
    tr = Transition(moe_layers=MOE, num_experts=8, top_k=2)
    for row in ([0, 1], [2, 3], [4, 5]):
        tr.observe(0, row)
    for row in ([6, 7], [6, 7], [1, 2]):
        tr.observe(2, row)
    assert tr.predict(0, [0, 1], None) == [(2, [6, 7])]
    assert tr.predict(0, [4], None) == [(2, [1, 2])]


def test_transition_does_not_link_across_sequences_or_gaps() -> None:
    tr = Transition(moe_layers=MOE, num_experts=8, top_k=2)
    tr.observe(5, [1])
    tr.reset_sequence()
    tr.observe(0, [2])  # 5 -> 0 is not a transition
    tr.observe(3, [4])  # 0 -> 3 skips layer 2: not a transition either
    assert tr.predict(5, [1], None) == [] and tr.predict(2, [2], None) == []
    assert tr.predict(0, [2], None) == []


def test_combined_rank_fusion() -> None:
    h = History(moe_layers=MOE, num_experts=8, top_k=3)
    tr = Transition(moe_layers=MOE, num_experts=8, top_k=3)
    c = Combined([h, tr], max_per_layer=2)
    c.observe(0, [0])
    c.observe(2, [5])
    for _ in range(3):
        c.reset_sequence()
        c.observe(0, [1])
        c.observe(2, [6, 7])
    assert isinstance(c, PrefetchStrategy)
    assert h.predict(0, [0], None) == [(2, [6, 7, 5])]
    assert tr.predict(0, [0], None) == [(2, [5])]
    # 5 is in both lists, so it beats 6, the top of one list; 7 is cut by max_per_layer.
    assert c.predict(0, [0], None) == [(2, [5, 6])]


def _routers(num_layers: int, hidden: int, experts: int, seed: int = 0):
    mx.random.seed(seed)
    weights = [mx.random.normal((experts, hidden)) for _ in range(num_layers)]

    def router_logits(layer: int, h: mx.array) -> mx.array:
        return h @ weights[layer].T

    return router_logits, weights


def test_next_gate_single_token_matches_numpy_topk() -> None:
    routers, weights = _routers(6, 16, 32)
    gate = NextGate(routers, moe_layers=MOE, num_experts=32, top_k=4, depth=2, extra=1)
    assert gate.name == "lookahead"
    h = mx.random.normal((16,))
    preds = gate.predict(0, [1, 2], h)
    assert [t for t, _ in preds] == [2, 3]
    for target, ids in preds:
        logits = np.array(h) @ np.array(weights[target]).T
        assert ids == [int(i) for i in np.argsort(-logits)[:5]]
    assert gate.predict(0, [1], h[None, :]) == preds  # [1, hidden] is one token
    assert gate.predict(5, [1], h) == [] and gate.predict(0, [1], None) == []


def test_next_gate_batch_covers_union_of_token_topk() -> None:
    routers, weights = _routers(6, 16, 32, seed=1)
    gate = NextGate(routers, moe_layers=MOE, num_experts=32, top_k=3)
    assert gate.name == "next-gate"
    h = mx.random.normal((5, 16))
    [(target, ids)] = gate.predict(3, [0], h)
    assert target == 5
    logits = np.array(h) @ np.array(weights[5]).T
    union = {int(i) for row in logits for i in np.argsort(-row)[:3]}
    assert set(ids) == union
    counts = {e: sum(e in set(np.argsort(-row)[:3].tolist()) for row in logits) for e in ids}
    assert [counts[e] for e in ids] == sorted(counts.values(), reverse=True)


def test_max_per_layer_cuts_a_gate_layers_predictions_to_its_best() -> None:
    """`prefetch.max_per_layer` reaches the gate strategies (it had cut only "combined"):
    a union is cut to the experts most of its tokens pick, one token's to its top logits,
    on every path a prediction takes (staged, unstaged, read back from the device)."""
    routers, _ = _routers(6, 16, 32, seed=1)
    h = mx.random.normal((5, 16))
    whole = NextGate(routers, moe_layers=MOE, num_experts=32, top_k=3, extra=1)
    cut = make_strategy("next-gate", moe_layers=MOE, num_experts=32, top_k=3, extra=1,
                        routers=routers, max_per_layer=2)
    assert isinstance(cut, NextGate) and cut.params()["max_per_layer"] == 2
    [(_, ids)] = whole.predict(3, [0], h)
    assert len(ids) > 2 and cut.predict(3, [0], h) == [(5, ids[:2])]
    mx.eval(*cut.prepare(3, h))
    assert cut.predict(3, [0], h) == [(5, ids[:2])]
    one = mx.random.normal((16,))
    [(_, top)] = whole.predict(3, [0], one)
    ranked = np.array(cut.ranking(3, one))
    assert len(top) == 4 and cut.predict_ranked(3, ranked) == [(5, top[:2])] == cut.predict(3, [0], one)
    assert whole.params()["max_per_layer"] is None
    with pytest.raises(ValueError, match="cap=0"):
        NextGate(routers, moe_layers=MOE, num_experts=32, top_k=3, cap=0)


def test_a_verify_pass_cap_is_one_and_a_half_top_k_unless_set() -> None:
    from pipeline.engine_sizing import pass_cap

    assert pass_cap("auto", 8) == 12 and pass_cap("auto", 10) == 15 and pass_cap("auto", 3) == 5
    assert pass_cap("off", 8) is None and pass_cap(12, 8) == 12


def test_next_gate_stages_a_verify_pass_union_in_the_routing_sync() -> None:
    """A pass's rows (several tokens at decode) are ranked in the routing's own sync, as
    one token's are: `predict` then reads what `prepare` built, the same union as
    without it, and runs no router of its own (no second host round trip)."""
    routers, _ = _routers(6, 16, 32, seed=2)
    calls = []

    def counted(layer: int, h: mx.array) -> mx.array:
        calls.append(layer)
        return routers(layer, h)

    gate = NextGate(counted, moe_layers=MOE, num_experts=32, top_k=3, depth=2, extra=1)
    h = mx.random.normal((3, 16))
    fresh = gate.predict(0, [0], h)
    calls.clear()
    staged = gate.prepare(0, h)
    mx.eval(*staged)
    assert len(calls) == 2  # the two target layers' routers, built into the sync
    assert gate.predict(0, [0], h) == fresh and len(calls) == 2
    assert all(len(ids) == len(set(ids)) for _, ids in fresh)


def test_make_strategy_registry() -> None:
    kw = {"moe_layers": MOE, "num_experts": 8, "top_k": 2}
    assert isinstance(make_strategy("none", **kw), NoPrefetch)
    assert isinstance(make_strategy("history", **kw), History)
    assert isinstance(make_strategy("transition", **kw), Transition)
    routers, _ = _routers(6, 4, 8)
    la = make_strategy("lookahead", routers=routers, depth=3, **kw)
    assert isinstance(la, NextGate) and la.depth == 3
    assert make_strategy("next-gate", routers=routers, depth=3, **kw).depth == 1
    comb = make_strategy("combined", combine=["history", "transition"], **kw)
    assert isinstance(comb, Combined) and comb.max_per_layer == 2
    with pytest.raises(ValueError, match="needs routers"):
        make_strategy("next-gate", **kw)
    with pytest.raises(ValueError, match="combine="):
        make_strategy("combined", **kw)
    with pytest.raises(ValueError, match="'oracle'.*none, next-gate"):
        make_strategy("oracle", **kw)


def test_scorer_precision_recall_and_wasted_bytes() -> None:
    s = PrefetchScorer(stride=1000)
    s.begin_token()
    s.score(0, [1, 2])  # nothing predicted for layer 0
    s.record([(2, [3, 4]), (3, [5])])
    s.record([(3, [6])])  # union with the earlier prediction for layer 3
    assert s.score(2, [3, 9]) == (2, 1)
    assert s.score(3, [5, 6]) == (2, 2)
    s.record([(5, [7])])
    s.begin_token()  # layer 5 never came: a wrong prediction
    st = s.stats()
    assert (st.predicted, st.correct, st.actual) == (5, 3, 6)
    assert st.precision == pytest.approx(3 / 5) and st.recall == pytest.approx(3 / 6)
    assert st.bytes_wasted == 2000


def test_the_cli_help_lists_every_registered_strategy() -> None:
    # The help is derived from the table: a new row shows up in `--help` on its own.
    from actors.prefetch import STRATEGIES
    from pipeline.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command" or a.choices)
    for command in ("generate", "serve", "bench"):
        text = " ".join(sub.choices[command].format_help().split())
        for name, row in STRATEGIES.items():
            assert f"{name}: {row.help}" in text, (command, name)
