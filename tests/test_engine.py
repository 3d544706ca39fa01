"""The actor engine end to end: every pool/prefetch/reader setting computes the same thing.

References are independent of the actors: greedy tokens from mlx-lm's model fully
resident (same chunking), logits from our forward driven by hand with every expert
resident (tests/helpers_forward.py). The live pool's hit rate must replay exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import trio
from helpers_engine import (
    engine_config,
    forward_logits,
    generate,
    greedy,
    pool_is_clean,
    pool_within_slots,
)
from helpers_forward import DirectForward, greedy_reference, reference_for, tiny_pair

from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.events import Done, TextDelta
from pipeline.replay import simulate

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]
PROMPT_B = [40, 1079, 264, 8, 3, 7000, 512, 2]
DECODE = (3, 141, 59, 26, 5)
MAX_TOKENS = 16
CHUNK = 2  # engine_config's prefill chunk: smallest workable pool is 8 slots

# One engine per case; together they cover every prefetch strategy, eviction policy,
# reader concurrency 1 and 4, staging in reader threads, overlap on and off, and pools from the smallest workable
# (8) to every expert (64).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "serial-lru-64": ("qwen3_next", {
        "pool": {"slots": 64, "eviction": "lru"},
        "compute": {"overlap": False},
    }),
    "next-gate-lfu-8-r4": ("qwen3_next", {
        "pool": {"slots": 8, "eviction": "lfu"},
        "reader": {"concurrency": 4},
        "prefetch": {"strategy": "next-gate"},
    }),
    # The queue depth measured at start; verify every read (crc32 on the staging threads).
    "next-gate-reuse-8-auto-verified": ("qwen3_5_moe", {
        "pool": {"slots": 8, "eviction": "reuse"},
        "reader": {"concurrency": "auto"},
        "model": {"verify": "always"},
    }),
    "lookahead2-slru-12-r1": ("qwen3_next", {
        "pool": {"slots": 12, "eviction": "slru"},
        "reader": {"concurrency": 1},
        "prefetch": {"strategy": "lookahead", "depth": 2},
    }),
    "history-lru-16-r4-staged": ("qwen3_next", {
        "pool": {"slots": 16, "eviction": "lru"},
        # Blobs become MLX arrays in the readers' threads (the GPU path's device_staging).
        "reader": {"concurrency": 4, "stage_in_threads": "on"},
        "prefetch": {"strategy": "history"},
    }),
    "transition-slru-24-r4": ("qwen3_5_moe", {
        "pool": {"slots": 24, "eviction": "slru"},
        "reader": {"concurrency": 4},
        "prefetch": {"strategy": "transition"},
    }),
    # Run-ahead tried on every decode token with a pool of 8: misses at every layer
    # position, each resumed layer by layer from the first missing one.
    "run-ahead-on-next-gate-lfu-8-r4": ("qwen3_next", {
        "pool": {"slots": 8, "eviction": "lfu"},
        "reader": {"concurrency": 4},
        "compute": {"run_ahead": "on"},
    }),
    "run-ahead-on-history-lru-40": ("qwen3_5_moe", {
        "pool": {"slots": 40, "eviction": "lru"},
        "prefetch": {"strategy": "history"},
        "compute": {"run_ahead": "on"},
    }),
    "next-gate+transition-lfu-8-r1": ("qwen3_5_moe", {
        "pool": {"slots": 8, "eviction": "lfu"},
        "reader": {"concurrency": 1},
        "prefetch": {"strategy": "combined", "combine": ["next-gate", "transition"]},
    }),
}


class Expected(NamedTuple):
    """mlx-lm's greedy tokens for PROMPT and PROMPT_B (not stopped at EOS: see `until_eos`),
    and our all-resident logits for PROMPT in chunks of CHUNK, then DECODE."""

    tokens_a: list[int]
    tokens_b: list[int]
    logits: list[np.ndarray]


_EXPECTED: dict[str, Expected] = {}  # per family, for the session; filled by the `want` fixture


@pytest.fixture
def pair(synth_checkpoint, packed):
    def get(family: str) -> tuple[Path, Path]:
        return tiny_pair(synth_checkpoint, packed, family, None)

    return get


@pytest.fixture
def family() -> str:
    """The family of a test that does not choose one (parametrize overrides it)."""
    return "qwen3_next"


@pytest.fixture
def want(pair, family) -> Expected:
    """`Expected` for `family`, computed once per session in the set-up of the first test
    that needs it (not in that test's call, where it would pass for the test's time)."""
    if family not in _EXPECTED:
        src, qpack = pair(family)
        ref = reference_for(src, None)
        tokens_a = greedy_reference(ref, PROMPT, MAX_TOKENS, set(), chunk=CHUNK)
        tokens_b = greedy_reference(ref, PROMPT_B, MAX_TOKENS, set(), chunk=CHUNK)
        ours = DirectForward(qpack)
        cache = ours.make_cache()
        logits = [ours.forward(PROMPT[i : i + CHUNK], cache, all_positions=False)[0][-1]
                  for i in range(0, len(PROMPT), CHUNK)]
        logits += [ours.forward([t], cache)[0][-1] for t in DECODE]
        ours.close()
        _EXPECTED[family] = Expected(tokens_a, tokens_b, [np.array(x) for x in logits])
    return _EXPECTED[family]


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Greedy tokens as a generation that stops at EOS returns them (the EOS included)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "family"), [(v, f) for v, (f, _) in VARIANTS.items()],
                         ids=list(VARIANTS))
async def test_same_tokens_logits_and_replayable_hit_rate_for_every_setting(pair, want, variant,
                                                                            family):
    _src, qpack = pair(family)
    config = engine_config(qpack, **VARIANTS[variant][1])
    async with open_engine(config, record_routing=True) as engine:
        eos = set(engine.tokenizer.eos_token_ids)
        want_a, want_b = until_eos(want.tokens_a, eos), until_eos(want.tokens_b, eos)
        want_logits = want.logits
        done = await generate(engine, PROMPT, MAX_TOKENS)
        assert list(done.token_ids) == want_a
        pool_is_clean(engine)  # the last prefetch orders landed: idle holds no read
        got = await forward_logits(engine, PROMPT, DECODE)
        assert len(got) == len(want_logits)
        for i, (a, b) in enumerate(zip(got, want_logits, strict=True)):
            assert a.dtype == b.dtype and np.array_equal(a, b), f"forward {i}"
        done_b = await generate(engine, PROMPT_B, MAX_TOKENS)
        assert list(done_b.token_ids) == want_b
        pool_is_clean(engine)
        assert engine.facts.slots == config.pool.slots

        live = engine._core.router.table.snapshot()
        trace = engine.routing_trace()
        assert trace.pool.num_slots == config.pool.slots
        assert trace.pool.policy == config.pool.eviction
        replay = simulate(
            trace, trace.pool.policy, trace.pool.policy_params, "recorded", trace.pool.num_slots
        )
        assert replay.hit_rate == live.hit_rate
        assert (replay.pool.hits, replay.pool.misses) == (live.hits, live.misses)
        assert replay.pool.evictions == live.evictions
        assert replay.pool.prefetch_installs == live.prefetch_installs


async def _cancel_after_deltas(engine: Any, prompt: list[int], deltas: int) -> int:
    seen = 0
    with trio.CancelScope() as scope:
        async for event in engine.generate(prompt, greedy(48)):
            if isinstance(event, TextDelta):
                seen += 1
                if seen == deltas:
                    scope.cancel()
    assert scope.cancelled_caught
    return seen


async def _cancel_after(engine: Any, prompt: list[int], seconds: float) -> None:
    with trio.move_on_after(seconds):
        async for _ in engine.generate(prompt, greedy(48)):
            pass


async def test_cancelled_generations_leave_a_clean_pool_and_concurrent_ones_agree(pair, want):
    """Cancel after 3 deltas, then at arbitrary points (mid-read, mid-layer); then run two
    generations at once. Every later run must equal a fresh model's tokens."""
    _src, qpack = pair("qwen3_next")
    config = engine_config(qpack, pool={"slots": 8}, reader={"concurrency": 4})
    async with open_engine(config) as engine:
        eos = set(engine.tokenizer.eos_token_ids)
        want_a, want_b = until_eos(want.tokens_a, eos), until_eos(want.tokens_b, eos)
        assert await _cancel_after_deltas(engine, PROMPT, 3) == 3
        pool_is_clean(engine)
        assert engine.waiting == 0 and not engine.busy
        before = engine.counters()
        done = await generate(engine, PROMPT, MAX_TOKENS)
        spent = engine.counters() - before
        assert list(done.token_ids) == want_a
        # A lone generation's stats are the engine's counters across it (reads that a
        # prefetch queued on its last token may land after its own snapshot).
        s = done.stats
        assert (s.hits, s.misses) == (spent.hits, spent.misses) and s.hits + s.misses > 0
        assert spent.bytes_read >= s.bytes_read and spent.reads >= s.reads

        # Wherever the cancel lands, nothing is left behind (no timing is asserted).
        for seconds in (0.0, 0.01, 0.05, 0.2):
            await _cancel_after(engine, PROMPT_B, seconds)
            pool_is_clean(engine)
            assert not engine.busy
        assert list((await generate(engine, PROMPT_B, MAX_TOKENS)).token_ids) == want_b

        results: dict[str, list[int]] = {}

        async def run(name: str, prompt: list[int]) -> None:
            results[name] = list((await generate(engine, prompt, MAX_TOKENS)).token_ids)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", PROMPT)
            nursery.start_soon(run, "b", PROMPT_B)
        assert results == {"a": want_a, "b": want_b}
        assert engine.waiting == 0
        pool_within_slots(engine)
        assert engine.pool_snapshot()["loads_in_flight"] == 0


async def test_run_ahead_with_every_expert_pooled_is_one_sync_per_token_and_exact(pair, want):
    """Every expert pooled: after the first token, decode runs ahead and never falls back;
    logits equal the per-layer path's bit for bit."""
    _src, qpack = pair("qwen3_next")
    config = engine_config(qpack, pool={"slots": 64})
    async with open_engine(config) as engine:
        want_logits = want.logits
        assert await engine.warm() == 64  # every expert read once
        assert await engine.warm() == 0
        before = engine.counters()
        got = await forward_logits(engine, PROMPT, DECODE)
        for i, (a, b) in enumerate(zip(got, want_logits, strict=True)):
            assert np.array_equal(a, b), f"forward {i}"
        spent = engine.counters() - before
        assert spent.run_ahead_tokens == len(DECODE), spent
        assert spent.run_ahead_misses == 0


async def test_an_abandoned_generation_stops_within_one_step_with_every_expert_pooled(pair):
    """A consumer that never awaits anything itself (like a non-streaming reply) is
    cancelled by a deadline: decoding stops at the next step, the engine is free."""
    _src, qpack = pair("qwen3_next")
    config = engine_config(qpack, pool={"slots": 64})
    async with open_engine(config) as engine:
        await generate(engine, PROMPT, 4)
        stamps: list[float] = []
        deadline = trio.current_time() + 0.3
        with trio.move_on_at(deadline):
            async for event in engine.generate(PROMPT_B, greedy(300)):
                if isinstance(event, TextDelta):
                    stamps.append(trio.current_time())
        late = [s for s in stamps if s > deadline]
        assert len(late) <= 1, f"{len(late)} tokens decoded after the cancel"
        assert not engine.busy
        pool_is_clean(engine)
        assert len((await generate(engine, PROMPT, 3)).token_ids) == 3


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
async def test_pipelined_decode_draws_the_same_sampled_tokens_as_one_step_at_a_time(pair, family):
    """Seeded sampling (temperature 1): decode queued one token ahead, with misses forcing
    roll-backs and redraws, gives the tokens of the unpipelined loop. A run cut by a stop
    token leaves a queued step behind, which is undone: a follow-up request resuming from
    the prefix cache gets the same tokens too."""
    _src, qpack = pair(family)
    # 8 tokens a run: a stop at the fifth still cuts one short, and misses (asserted
    # below) force roll-backs within a few steps; each token here costs ~40 ms of CPU.
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    results: dict[str, list[list[int]]] = {}
    for mode in ("off", "on"):
        config = engine_config(qpack, pool={"slots": 12}, compute={"run_ahead": mode})
        async with open_engine(config) as engine:
            runs = await _runs_with_a_stop(engine, params, 4)
            if mode == "on":
                assert engine.counters().run_ahead_misses > 0  # roll-backs happened
            pool_is_clean(engine)
        results[mode] = runs
    assert results["on"] == results["off"]


async def test_a_second_queued_step_with_every_expert_pooled_draws_the_same_tokens(pair):
    """Every expert pooled, a lone row: decode queues a second step while the host does the
    last token's bookkeeping (`compute.decode_ahead`). Seeded sampling gives the tokens of
    one queued step; a stop token cuts a run with two steps queued, both undone (a follow-up
    resuming from the prefix cache gets the same tokens too)."""
    _src, qpack = pair("qwen3_next")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10)
    results: dict[str, list[list[int]]] = {}
    for mode in ("off", "on"):
        # the embedding resident, as on GPUs (a table on file reads each token on the host first)
        config = engine_config(qpack, pool={"slots": 64}, compute={"decode_ahead": mode},
                               memory={"embedding": "resident"})
        async with open_engine(config) as engine:
            await engine.warm()
            before = engine.counters()
            runs = await _runs_with_a_stop(engine, params, 5)
            spent = engine.counters() - before
            assert spent.run_ahead_misses == 0
            # a run of n tokens queues its steps 2 .. n-1 second (its last is never queued)
            assert (spent.ahead_steps > 0) == (mode == "on"), spent
            pool_is_clean(engine)
        results[mode] = runs
    assert results["on"] == results["off"]


async def test_a_queued_step_whose_expert_was_evicted_under_it_is_redone(pair, monkeypatch):
    """A pipelined step reads ready experts through the slot map it was launched from, while
    the token before's bookkeeping may prefetch: evict a ready expert and land another's
    read in its slot (on the CPU a memcpy, not ordered with MLX's stream). Here, before each
    such bookkeeping, an expert the queued step routes to (its first MoE layer's, read
    early) is evicted and another expert's read lands in its slot, and only then does the
    queued step run (MLX's async evaluation deferred to its reading, as a busy CPU stream
    may): that layer must count as a miss and be redone, never computed from the other
    expert's weights. Greedy tokens as stepping's."""
    import numpy as np

    import actors.compute as compute_mod
    import actors.decode as decode_mod

    _src, qpack = pair("qwen3_next")
    account, step = compute_mod.Compute.account, decode_mod.Decoder._step
    queued: list[Any] = []
    moved: list[tuple[int, int]] = []

    def stashing(self: Any, current: Any, more: int) -> Any:
        out = step(self, current, more)
        queued[:] = [out[2]]
        return out

    async def meddling(self: Any, result: Any, phase: str) -> Any:
        nxt = queued.pop() if queued else None
        if phase == "decode" and nxt is not None:
            table, layer = self.router.table, result.layers[0]
            ids = await self.worker.run(np.asarray, nxt.lazy.ids[0])  # the queued step's routing
            victims = [(layer, int(e)) for e in np.unique(ids)
                       if table.ready((layer, int(e))) and table.pin_count((layer, int(e))) == 0]
            spare = [e for e in range(self.router.num_experts) if (layer, e) not in table]
            if victims and spare:
                table.release(victims[0])  # evicted: its slot is free, and taken at once
                await self.router.prefetch([(layer, [spare[0]])], self.tick)
                for _ in range(400):
                    await self.router.install_now()
                    if not self.router.loads:
                        break
                    await trio.sleep(0.005)
                moved.append(victims[0])
        return await account(self, result, phase)

    results: dict[str, list[int]] = {}
    for mode in ("off", "on"):
        config = engine_config(qpack, pool={"slots": 60}, compute={"run_ahead": mode},
                               prefetch={"strategy": "none"})
        with monkeypatch.context() as m:
            m.setattr(compute_mod.Compute, "account", meddling)
            m.setattr(decode_mod.Decoder, "_step", stashing)
            m.setattr(decode_mod.mx, "async_eval", lambda *a: None)
            async with open_engine(config) as engine:
                for prompt in (PROMPT, PROMPT_B):  # the first fills the pool
                    results.setdefault(mode, []).extend((await generate(engine, prompt, 16)).token_ids)
                if mode == "on":  # queued steps ran, and some found their expert moved
                    assert engine.counters().run_ahead_misses > 0 and moved
                pool_is_clean(engine)
    assert results["on"] == results["off"]  # without the check, 13 moves changed the 23rd token


async def _runs_with_a_stop(engine: Any, params: SamplingParams, at: int) -> list[list[int]]:
    """Two prompts' tokens; the first again, cut by a stop token at its `at`-th (a step
    queued behind the stop is undone); then a prompt resuming from the cut run's cached
    state (the prefix cache holds every token the cut run fed)."""
    runs = [list((await _last(engine.generate(p, params))).token_ids) for p in (PROMPT, PROMPT_B)]
    stop = runs[0][at]
    cut = msgspec.structs.replace(params, stop_token_ids=(stop,))
    runs.append(list((await _last(engine.generate(PROMPT, cut))).token_ids))
    assert runs[-1][-1] == stop and len(runs[-1]) < params.max_tokens
    done = await _last(engine.generate(PROMPT + runs[-1][:-1] + [5], params))
    assert done.stats.cached_tokens == len(PROMPT) + len(runs[-1]) - 1
    runs.append(list(done.token_ids))
    return runs


async def _last(events: Any) -> Any:
    return [e async for e in events][-1]


async def test_reads_installed_where_they_land_compute_what_installs_at_the_demand_do(pair):
    """Landing (actors/reader.py): reads installed by their disk thread between layers,
    including reads whose key was evicted before they landed (abandoned: they must write
    nothing), give the logits the install at the next demand gives, bit for bit."""
    _src, qpack = pair("qwen3_next")
    runs: dict[bool, tuple[list[int], list[np.ndarray], Any]] = {}
    for land in (True, False):
        config = engine_config(qpack, pool={"slots": 8, "eviction": "lru"},
                               reader={"concurrency": 4, "land": "on" if land else "off"},
                               prefetch={"strategy": "lookahead", "depth": 2})
        async with open_engine(config) as engine:
            done = await generate(engine, PROMPT, MAX_TOKENS)
            pool_is_clean(engine)
            assert not engine._core.router.orphans  # abandoned reads gave their buffers back
            logits = await forward_logits(engine, PROMPT, DECODE)
            runs[land] = (list(done.token_ids), logits,
                          (engine._core.router.reader.stats, engine._core.router.stats))
    (tokens_on, logits_on, (reader_on, router_on)), (tokens_off, logits_off, (reader_off, _)) = (
        runs[True], runs[False])
    assert tokens_on == tokens_off
    for i, (a, b) in enumerate(zip(logits_on, logits_off, strict=True)):
        assert np.array_equal(a, b), f"forward {i}"
    assert reader_on.landings > reader_on.reads // 2, (reader_on.landings, reader_on.reads)
    assert reader_off.landings == 0
    # Predictions two layers ahead outrun 8 slots: some are evicted in flight.
    assert router_on.landings_abandoned > 0


async def test_a_prompts_last_token_steps_with_its_last_chunk_as_it_computes_alone(pair):
    """With room for a layer's experts (16 slots: top-4 of 16), the last chunk and the
    last token go through the layers together, each layer's experts demanded once: the
    sampled tokens are those of the two forwards one after the other (8 slots, where
    the pair does not fit), and a prompt sent again restarts from the pair's checkpoint
    (taken layer by layer between the two steps) to the same tokens."""
    _src, qpack = pair("qwen3_next")
    prompt = PROMPT[:7]  # chunks of 2, 2, 2, then the last token
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, logprobs=3)
    runs = []
    for slots, paired in ((16, 1), (8, 0)):
        async with open_engine(engine_config(qpack, pool={"slots": slots})) as engine:
            events = await _events(engine, prompt, params)
            assert engine._core.compute.stats.paired_prompts == paired
            runs.append(_sampled(events))
            if paired:
                again = await _events(engine, prompt, params)
                assert again[-1].stats.cached_tokens == len(prompt) - 1
                assert _sampled(again) == runs[0]
    assert runs[0] == runs[1]


async def _events(engine: Any, prompt: list[int], params: SamplingParams) -> list[Any]:
    events = [e async for e in engine.generate(prompt, params)]
    assert isinstance(events[-1], Done)
    return events


def _sampled(events: list[Any]) -> list[Any]:
    """Each token with its log-probability and the top 3 (floats compared exactly)."""
    return [(lp.token, lp.logprob, lp.top) for e in events if isinstance(e, TextDelta) for lp in e.logprobs]

