"""Speculative decoding: the tokens, log-probabilities, text and cached states of plain decode.

Drafts come from a reference run's own tokens with a seeded fraction corrupted
(`EmulatedDrafts`: random-weight models never repeat, so prompt lookup alone would
draft nothing), so passes keep some drafts and reject others at every draft length.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from helpers_engine import engine_config
from helpers_forward import tiny_pair

from actors.sampling_params import SamplingParams
from actors.speculative.accept import speculative_sample
from actors.speculative.ngram import NgramDrafter
from actors.speculative.policy import SpeculationPolicy
from pipeline.engine import open_engine
from pipeline.engine_hooks import emulate_drafts
from pipeline.events import Done, TextDelta
from pipeline.prefix_cache import _arrays
from pipeline.speculation import EmulatedDrafts

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]
TOKENS = 12


async def _run(engine: Any, params: SamplingParams, prompt: list[int] = PROMPT) -> list[Any]:
    return [e async for e in engine.generate(list(prompt), params)]


def _done(events: list[Any]) -> Done:
    assert isinstance(events[-1], Done)
    return events[-1]


def _deltas(events: list[Any]) -> list[tuple[str, tuple[int, ...], Any]]:
    return [(e.text, e.token_ids, e.logprobs) for e in events if isinstance(e, TextDelta)]


@pytest.fixture
def container(synth_checkpoint, packed, family, bits):
    """The tiny container of (family, bits), made in the set-up (shared with other tests)."""
    return tiny_pair(synth_checkpoint, packed, family, bits)[1]


@pytest.fixture
def family():
    return "qwen3_next"


@pytest.fixture
def bits():
    return None


@pytest.mark.parametrize(("family", "bits", "slots", "run_ahead", "lengths"), [
    # The smallest pool: passes that miss, resumed per layer; the guard cuts k to 1.
    ("qwen3_next", None, 8, "on", ((3, 0.7),)),
    # 4-bit, per layer, reads in every pass.
    ("qwen3_5_moe", 4, 16, "off", ((2, 0.6),)),
])
async def test_greedy_tokens_equal_plain_decode_at_every_draft_length(
        container, family, bits, slots, run_ahead, lengths):
    qpack = container
    cap = 5  # prefetch.pass_max_per_layer: above one token's top-4, under a pass's union
    config = engine_config(qpack, pool={"slots": slots}, compute={"run_ahead": run_ahead},
                           prefetch={"pass_max_per_layer": cap})
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    async with open_engine(config, record_routing=True) as engine:
        await _same_greedy_tokens(engine, greedy, lengths)
        # Reads shared by the pass: each layer of a verify pass demanded the union of its
        # positions' experts from the pool, each expert once.
        await engine._core.compute.prefetcher.caught_up()
        recorder = engine._core.compute.recorder
        assert recorder is not None
        steps = recorder.trace.steps
        passes = [st for st in steps if st.phase == "decode" and len(st.layers[0].observed()) > 1]
        assert passes
        for st in passes:
            for entry in st.layers:
                union = list(dict.fromkeys(e for row in entry.observed() for e in row))
                assert entry.chosen == union
        # A pass's predictions are cut to the cap (the tokens above stayed plain decode's);
        # a prompt chunk's union is not.
        def widths(phase: str) -> list[int]:
            return [len(ids) for st in steps if st.phase == phase and len(st.layers[0].observed()) > 1
                    for entry in st.layers for _, ids in entry.predictions]
        assert widths("decode") and max(widths("decode")) == cap
        assert max(widths("prefill")) > cap


async def _same_greedy_tokens(engine: Any, greedy: SamplingParams, lengths: Any) -> tuple[int, ...]:
    """Plain decode's tokens, and the same from every (draft length, acceptance)."""
    plain = _done(await _run(engine, greedy)).token_ids
    guard = engine._core.batch.speculation.longest
    assert guard == min(3, engine.facts.slots // engine.facts.top_k - 1)
    for k, acceptance in lengths:
        engine._core.batch.speculation.max_draft = k
        emulate_drafts(engine, EmulatedDrafts(plain, acceptance, seed=k))
        params = msgspec.structs.replace(greedy, speculative="ngram")
        done = _done(await _run(engine, params))
        assert done.token_ids == plain, f"k={k}"
        s = done.stats
        assert s.speculative == "ngram" and s.verify_passes > 0
        # Some drafts kept, some rejected; a pass never drafts past the guard.
        assert 0 < s.drafts_accepted < s.drafts_proposed <= s.verify_passes * min(k, guard)
        assert s.tokens_per_pass == pytest.approx(
            (s.drafts_accepted + s.verify_passes) / s.verify_passes, abs=1e-3)
    return plain


async def test_greedy_logprobs_penalties_seeded_sampling_stops_and_prefix_cache_as_plain(container):
    qpack = container
    # The engine loads the container's MTP head (speculative = "mtp"); plain runs say "off".
    config = engine_config(qpack, pool={"slots": 64},
                           compute={"run_ahead": "on", "speculative": "mtp"})
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, speculative="off")
    cases = {
        "logprobs+penalties": SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=2,
                                             repetition_penalty=1.3, presence_penalty=0.5,
                                             speculative="off"),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=TOKENS,
                                 speculative="off"),
    }
    async with open_engine(config) as engine:
        # Every expert pooled: each pass is one sync; greedy at every draft length.
        plain = await _same_greedy_tokens(engine, greedy, ((1, 0.7), (3, 0.6)))
        # MTP drafts (random weights: rarely right) are verified as exactly.
        done = _done(await _run(engine, msgspec.structs.replace(greedy, speculative="mtp")))
        assert done.token_ids == plain
        assert done.stats.speculative == "mtp" and done.stats.drafts_proposed > 0
        engine._core.batch.speculation.max_draft = 3
        for name, params in cases.items():
            emulate_drafts(engine, None)
            plain = await _run(engine, params)
            tokens = _done(plain).token_ids
            emulate_drafts(engine, EmulatedDrafts(tokens, 0.8, seed=3))
            spec = msgspec.structs.replace(params, speculative="ngram")
            got = await _run(engine, spec)
            assert _deltas(got) == _deltas(plain), name
            assert _done(got).stats.drafts_accepted > 0, name
            if name != "logprobs+penalties":
                continue
            emulate_drafts(engine, None)
            # A stop string inside the text: generation ends in the middle of a pass.
            text = _done(plain).text
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            stopped = msgspec.structs.replace(params, stop=(stop,))
            plain_stop = await _run(engine, stopped)
            done = _done(plain_stop)
            assert done.finish_reason == "stop", name
            kept = PROMPT + list(done.token_ids[:-1])
            want_state, n = await engine._core.worker.run(engine.prefix_cache.take, [*kept, 0])
            assert n == len(kept)
            engine.prefix_cache.clear()
            emulate_drafts(engine, EmulatedDrafts(tokens, 0.8, seed=3))
            got_stop = await _run(engine, msgspec.structs.replace(stopped, speculative="ngram"))
            assert _deltas(got_stop) == _deltas(plain_stop), name
            # The state kept for a follow-up is plain decode's, bit for bit.
            state, n = await engine._core.worker.run(engine.prefix_cache.take, [*kept, 0])
            assert n == len(kept)
            for a, b in zip(_arrays(state), _arrays(want_state), strict=True):
                assert mx.array_equal(a, b).item(), name
            engine.prefix_cache.clear()
        # A grammar's mask (a constraint advanced by every drawn token, a fresh one per
        # request): drafts it forbids are rejected, the tokens are plain decode's.
        emulate_drafts(engine, None)
        masked = msgspec.structs.replace(cases["seeded"], constraint=_Alternate(engine.facts.vocab_size))
        plain = await _run(engine, masked)
        tokens = _done(plain).token_ids
        assert all(t % 2 == i % 2 for i, t in enumerate(tokens))
        emulate_drafts(engine, EmulatedDrafts(tokens, 0.8, seed=5))
        spec = msgspec.structs.replace(masked, speculative="ngram",
                                       constraint=_Alternate(engine.facts.vocab_size))
        got = await _run(engine, spec)
        assert _deltas(got) == _deltas(plain)
        assert 0 < _done(got).stats.drafts_accepted < _done(got).stats.drafts_proposed


class _Alternate:
    """A grammar of the test's own: even and odd token ids in turn, from an even one."""

    def __init__(self, vocab: int) -> None:
        self.ids, self.n = np.arange(vocab), 0

    def allowed(self) -> np.ndarray:
        return self.ids % 2 == self.n % 2

    def advance(self, token: int) -> None:
        self.n += 1


async def _auto_on_emulated(container: Any, acceptance: float, hits_before: int = 0, warm: bool = False,
                            tokens: int = 24, **compute: Any) -> tuple[list[int], Done, Any, Any]:
    """Plain greedy decode's `tokens`, then `auto` on drafts from them at `acceptance`
    (the same engine), after `hits_before` shadow trials that hit: (plain tokens, auto's
    Done, the engine's policy, auto's counters). `warm`: every expert pooled, the embedding
    resident (as on GPUs: a second step may be queued)."""
    memory = {"embedding": "resident"} if warm else {}
    config = engine_config(container, pool={"slots": 64}, compute=compute, memory=memory)
    async with open_engine(config) as engine:
        if warm:
            await engine.warm()
        greedy = SamplingParams(temperature=0.0, max_tokens=tokens, speculative="off")
        plain = list(_done(await _run(engine, greedy)).token_ids)
        for _ in range(hits_before):
            engine._core.batch.speculation.after_shadow(True)
        emulate_drafts(engine, EmulatedDrafts(plain, acceptance, seed=1))
        before = engine.counters()
        done = _done(await _run(engine, msgspec.structs.replace(greedy, speculative="auto")))
        return plain, done, engine._core.batch.speculation, engine.counters() - before


async def test_auto_prices_plain_decode_by_its_pipelined_steps_not_the_restart_after_a_pass(container):
    """With every expert pooled plain decode is pipelined (each step queued behind the
    last). The step after a pass restarts the pipeline (a forward, then the next queued)
    and costs more: `auto` must not take it as plain decode's price."""
    # Trials that hit earlier (another text) let the first step pass; its drafts are all
    # rejected, and the plain steps after it follow whatever the prices say.
    tokens, done, policy, _ = await _auto_on_emulated(container, 0.0, hits_before=10, run_ahead="on")
    assert list(done.token_ids) == tokens and done.stats.verify_passes >= 1
    # One plain step restarted the pipeline after each pass that plain steps followed.
    assert 1 <= policy.plain_priced < policy.stats.plain_steps


async def test_auto_on_drafts_that_never_hit_makes_no_pass_and_the_tokens_of_plain_decode(container):
    """A text that does not repeat (every draft wrong): `auto` learns it from shadow
    drafts at plain steps and never pays for a verify pass (on MLX's CPU the first pass
    and two probes cost 16 % of a 48-token decode)."""
    tokens, done, policy, _ = await _auto_on_emulated(container, 0.0)
    assert list(done.token_ids) == tokens
    assert done.stats.verify_passes == 0 and policy.stats.passes == 0
    assert policy.stats.shadowed == 24 - 1  # every token but the last (no room for a draft)


@pytest.mark.parametrize("hits_before", [0, 10])
async def test_auto_backed_off_queues_a_second_step_as_plain_decode_does(container, hits_before):
    """Every expert pooled, `auto` backed off queues a second step at its plain steps, as
    plain decode does (`compute.decode_ahead`, `SpeculationPolicy.quiet`): drafts that never
    hit, hopeless from the first trial on, or (after trials that hit) losing after passes
    whose drafts were all rejected, where each probe pass undoes both queued steps."""
    tokens, done, policy, spent = await _auto_on_emulated(container, 0.0, hits_before, warm=True,
                                                          tokens=40, decode_ahead="on")
    assert list(done.token_ids) == tokens
    assert spent.ahead_steps > 0 and spent.run_ahead_misses == 0
    assert (done.stats.verify_passes > 0) == (hits_before > 0) and (policy.stats.backoffs > 0) == (hits_before > 0)


async def test_bench_warm_ups_pass_every_draft_length_and_a_cold_case_starts_auto_afresh(container):
    """Before a speculative case's measured run the bench decodes with passes of each draft
    length (MLX's CUDA backend compiles a kernel per new shape); every expert pooled,
    `auto` keeps those prices; cold, it forgets them (they ran on a pool the warm-up itself warmed)."""
    from pipeline.bench.cases import _tokens, _warm_passes
    from pipeline.bench.spec import Case
    from pipeline.bench.speculative import spec_case_fields

    config = engine_config(container, pool={"slots": 64}, compute={"speculative": "auto"})
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for name in ("warm-spec-auto-a1.0", "spec-auto-a1.0"):
        case = Case(name=name, model="m", **spec_case_fields(name, {}))
        async with open_engine(config) as engine:
            reference = await _tokens(engine, PROMPT, params)
            await _warm_passes(engine, case, PROMPT, params, reference)
            policy = engine._core.batch.speculation
        if case.warm_all:
            assert set(policy.passes_of) == {1, 2, 3}  # each length passed (and compiled)
        else:
            assert policy.passes_of == {} and policy.plain_s is None and policy.stats.passes == 0


async def test_auto_speculates_when_drafts_pay_and_backs_off_when_they_do_not():
    policy = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    assert policy.draft_len("auto", 10) == 1  # the cheapest pass is measured first
    policy.after_pass(1, 1, seconds=0.012)
    assert policy.draft_len("auto", 10) == 0  # ... then a plain step
    policy.after_plain(0.010)
    # Every draft kept at 1.2x a plain step's cost: speculate at the longest length.
    assert policy.draft_len("auto", 10) == 3
    assert policy.draft_len("auto", 1) == 1  # never past the row's room
    # Nothing kept at twice the cost (the colibri case): stop, then probe rarely.
    for _ in range(40):
        policy.after_pass(3, 0, seconds=0.020)
        policy.after_pass(1, 0, seconds=0.020)
    picks = [policy.draft_len("auto", 10) for _ in range(400)]
    assert policy.stats.backoffs == 1
    assert 0 < sum(1 for k in picks if k) <= 8  # probes, each one token, doubling apart
    assert policy.draft_len("ngram", 10) == 3  # an explicit mode always drafts
    assert SpeculationPolicy(max_draft=3, pinnable_rows=1).draft_len("ngram", 10) == 0


def test_auto_asks_a_free_drafter_at_plain_steps_and_passes_only_where_its_drafts_could_pay():
    """Shadow drafts: prompt lookup is asked at every plain step and its guess compared
    with the step's token. A text whose guesses all miss never pays for a pass (each
    would give one token); guesses that hit start passes, and resume them after a
    back-off without waiting for a probe."""
    losing = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    picks = []
    for _ in range(300):
        picks.append(losing.draft_len("auto", 10, shadow="free"))
        losing.after_shadow(False)
        losing.after_plain(0.010)
    assert picks == [0] * 300 and losing.stats.passes == 0 and losing.stats.shadowed == 300
    assert losing.draft_len("auto", 10) == 1  # a drafter that is not shadowed still probes

    policy = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    assert policy.draft_len("auto", 10, shadow="free") == 0  # no trial yet
    policy.after_shadow(True)  # the first token's (drawn from the prompt's logits)
    assert policy.draft_len("auto", 10, shadow="free") == 1  # a hit: the cheapest pass
    policy.after_pass(1, 0, seconds=0.030)
    policy.after_pass(1, 0, seconds=0.030)  # steady price: 3 plain steps, nothing kept
    policy.after_plain(0.010)
    assert policy.draft_len("auto", 10, shadow="free") == 0 and policy.stats.backoffs == 1
    # A probe loses ~1.5 steps (3 steps' time for 1 + a tokens): the next one waits until
    # that is within 2 % of the plain decode between them (~77 steps, not 8) ...
    loss_steps = 3.0 - (1.0 + policy.acceptance)
    assert policy._wait + 1 >= loss_steps / 0.02 > 50
    # ... but guesses that hit show a text that repeats: with passes at 1.2x a step,
    # speculation resumes at once, no probe needed.
    policy.after_pass(1, 1, seconds=0.012)
    for _ in range(30):
        policy.after_shadow(True)
    assert policy.draft_len("auto", 10, shadow="free") == 3


def test_auto_asks_a_costly_drafter_for_one_trial_then_as_rarely_as_its_cost_allows():
    """An MTP head runs a layer to answer (its first trial the whole prompt): asked at the
    first plain step, then only when a trial is due, at intervals that double and keep
    its cost within 2 % of plain decode, while its drafts never hit."""
    policy = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    asked = []
    for _ in range(600):
        assert policy.draft_len("auto", 10, shadow="costly") == 0
        wanted = policy.shadow_wanted(free=False)
        asked.append(wanted)
        if wanted:
            policy.after_shadow(False, seconds=0.100)
        policy.after_plain(0.180)
    steps = [i for i, a in enumerate(asked) if a]
    assert steps[0] == 0 and steps[1] >= 8
    # A trial costs 0.56 of a step: >= 28 steps apart once it is priced, then doubling.
    gaps = [b - a for a, b in zip(steps[1:], steps[2:], strict=False)]
    assert gaps and all(g >= 28 for g in gaps) and len(steps) <= 8
    # A new generation's first trial: where it fits 2 % of the generation's plain decode
    # (0.100 s against 0.180 x 0.02 a token: 28 tokens or more), or before it is priced.
    assert not policy.new_text_trial(27) and policy.new_text_trial(28)
    assert SpeculationPolicy().new_text_trial(1)
    # A trial that hits (the text began to repeat) lets a pass be tried at once.
    for _ in range(6):
        policy.after_shadow(True)
    assert policy.draft_len("auto", 10, shadow="costly") == 1


def test_auto_prices_a_length_by_its_second_pass_not_the_first_that_compiled_its_kernels():
    """On CUDA a length's first pass compiles (x20 a plain step here): it must not keep
    `auto` backed off once a probe pass of that length shows the steady price."""
    policy = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    assert policy.draft_len("auto", 10) == 1
    policy.after_pass(1, 1, seconds=0.200)  # compiled
    policy.after_plain(0.010)
    picks = [policy.draft_len("auto", 10) for _ in range(8)]
    assert picks == [0] * 8 and policy.stats.backoffs == 1  # losing on the compile's price
    assert policy.draft_len("auto", 10) == 1  # the probe
    policy.after_pass(1, 1, seconds=0.012)  # the steady price replaces the first
    assert policy.pass_s[1] == 0.012
    assert policy.draft_len("auto", 10) == 3  # speculating again, at the longest length
    policy.after_pass(3, 3, seconds=0.014)
    policy.after_pass(3, 3, seconds=0.016)
    policy.after_pass(3, 3, seconds=0.016)
    assert abs(policy.pass_s[3] - 0.016) < 1e-12  # from the second on, averaged
    # A longer length's first pass compiled too (only length 1 is probed): priced as the
    # nearest steady length until its own second pass, not locked out by the compile.
    policy = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    policy.after_pass(1, 1, seconds=0.012)
    policy.after_pass(1, 1, seconds=0.012)
    policy.after_plain(0.010)
    assert policy.draft_len("auto", 10) == 3
    policy.after_pass(3, 3, seconds=0.300)  # compiled: 30 plain steps
    assert policy.draft_len("auto", 10) == 3  # tried again ...
    policy.after_pass(3, 3, seconds=0.016)
    assert policy.pass_s[3] == 0.016 and policy.draft_len("auto", 10) >= 2  # ... and priced


def test_a_back_off_after_trials_that_recovered_probes_soon_again():
    """Costly trials that never hit double their interval; once they hit and passes pay,
    a later back-off starts probing after the first interval again, not the last one."""
    policy = SpeculationPolicy(max_draft=3, pinnable_rows=8)
    for _ in range(3000):  # hopeless: trials at doubling intervals
        policy.draft_len("auto", 10, shadow="costly")
        if policy.shadow_wanted(free=False):
            policy.after_shadow(False, seconds=0.001)
        policy.after_plain(0.010)
    assert policy._probe_every == 512
    for _ in range(40):
        policy.after_shadow(True)  # the text began to repeat
    assert policy.draft_len("auto", 10, shadow="costly") == 1
    policy.after_pass(1, 1, seconds=0.012)
    policy.after_pass(1, 1, seconds=0.012)
    assert policy.draft_len("auto", 10, shadow="costly") >= 1  # paying
    for i in range(40):  # then passes cost 3 plain steps for 1.5 tokens: a back-off
        policy.after_pass(1, i % 2, seconds=0.030)
    policy.draft_len("auto", 10, shadow="costly")
    assert policy.stats.backoffs == 1 and policy._probe_every < 512


def test_prompt_lookup_drafts_the_continuation_of_the_latest_longest_match():
    d = NgramDrafter([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], max_n=3, min_n=2)
    assert d.propose(3) == [4, 9, 2]  # the 3-gram "1 2 3" wins over the later "2 3"
    d = NgramDrafter([2, 3, 4, 2, 3, 5, 2, 3], max_n=3, min_n=2)
    assert d.propose(2) == [5, 2]  # the latest "2 3"
    d.extend([7])
    assert d.propose(2) == []  # "3 7" never seen
    assert d.propose(0) == []


def test_speculative_sampling_draws_from_the_target_distribution():
    """Drafts from q, kept with min(1, p/q), else redrawn from the residual: tokens ~ p."""
    vocab, n = 6, 60_000
    p = mx.array([0.05, 0.4, 0.1, 0.2, 0.05, 0.2])
    q = mx.array([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    draft = mx.random.categorical(mx.log(mx.broadcast_to(q, (n, vocab))), key=mx.random.key(1))
    tokens, kept = speculative_sample(mx.broadcast_to(p, (n, vocab)), mx.broadcast_to(q, (n, vocab)),
                                      draft, mx.random.key(2))
    counts = np.bincount(np.array(tokens), minlength=vocab)
    expected = np.array(p) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p < 0.001 by chance
    # The acceptance rate is sum(min(p, q)) (0.5 here).
    rate = float(mx.minimum(p, q).sum())
    assert math.isclose(float(np.array(kept).mean()), rate, abs_tol=0.01)


def test_bench_speculative_cases_run_after_the_plain_reference_they_draft_from():
    from pipeline.bench.spec import Case
    from pipeline.bench.speculative import is_spec_case, spec_case_fields, with_references

    base = {"pool": {"budget_mb": 1024}, "compute": {"prefill_chunk": 0}}
    assert all(is_spec_case(n) for n in ("spec-k2-a0.8", "warm-spec-auto-a0.5", "spec-auto", "spec-mtp"))
    assert not any(is_spec_case(n) for n in ("spec", "spec-k9-a0.8", "spec-k2-a2", "default"))
    cases = [Case(name=n, model="m", **spec_case_fields(n, base))
             for n in ("spec-k2-a0.8", "warm-spec-auto-a0.7", "spec-auto")]
    k2 = cases[0]
    assert k2.config["compute"] == {"prefill_chunk": 0, "speculative": "ngram", "draft_tokens": 2}
    assert (k2.emulate, k2.reference, k2.warm_all) == (0.8, "default", False)
    assert cases[2].emulate is None  # real prompt lookup: no reference needed
    planned = [c.name for c in with_references([Case(name="io", model="m"), *cases])]
    assert planned == ["io", "spec-auto", "default", "spec-k2-a0.8", "warm-all", "warm-spec-auto-a0.7"]
    plain = next(c for c in with_references(cases) if c.name == "warm-all")
    assert plain.warm_all and plain.config["compute"]["speculative"] == "off"
