"""Speculation with the MTP head, its experts streamed: plain decode's tokens at every
pool size (the head's own pool evicting between passes included), the resident head's
drafts from a container packed before, and the memory the engine counts for it."""

from __future__ import annotations

import shutil
from typing import Any

import msgspec
import pytest
import trio
from helpers_engine import engine_config
from helpers_forward import tiny_pair
from helpers_mtp import legacy_container

from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.events import Done
from qpack.mtp import MTP_FILE
from qpack.reader import Container

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, speculative="off")


async def _done(engine: Any, params: SamplingParams) -> Done:
    events = [e async for e in engine.generate(list(PROMPT), params)]
    assert isinstance(events[-1], Done)
    return events[-1]


async def _plain_and_mtp(qpack: Any, **sections: Any) -> tuple[Done, Done, Any]:
    config = engine_config(qpack, **{**sections, "compute": {"speculative": "mtp",
                                                              **sections.get("compute", {})}})
    async with open_engine(config) as engine:
        plain = await _done(engine, GREEDY)
        spec = await _done(engine, msgspec.structs.replace(GREEDY, speculative="mtp"))
        experts = engine._core.mtp.experts
        snap = engine.pool_snapshot()  # the head's pool counted apart from the model's
        counts = experts.pool.snapshot() if experts is not None else None
        assert snap["mtp_misses"] == (counts.misses if counts else 0)
        return plain, spec, counts


@pytest.mark.parametrize(("slots", "mtp_slots", "run_ahead"), [
    (8, 4, "on"),  # the smallest pools: the head's top-k alone, evicted between forwards
    (16, 8, "off"),
    (64, None, "on"),  # every expert pooled: the head's share is all of its experts
])
async def test_mtp_greedy_tokens_equal_plain_decode_at_every_pool_size(
        synth_checkpoint, packed, slots, mtp_slots, run_ahead):
    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    plain, spec, counts = await _plain_and_mtp(
        qpack, pool={"slots": slots, "mtp_slots": mtp_slots}, compute={"run_ahead": run_ahead})
    assert spec.token_ids == plain.token_ids
    assert spec.stats.speculative == "mtp" and spec.stats.drafts_proposed > 0
    assert counts.num_slots == (mtp_slots or 16) and counts.misses > 0
    assert (counts.evictions > 0) == (mtp_slots is not None)


async def test_auto_tries_the_head_on_a_new_generation_where_the_trial_fits_its_decode(
        synth_checkpoint, packed):
    """`auto` asks an MTP head (a costly drafter) rarely once its trials miss; a new
    generation is a new text: its first token is compared once, whatever the engine's
    policy learnt before, where that trial costs within 2 % of the generation's plain
    decode (a 12-token generation skips a trial priced at 1,000 plain steps). The tokens
    stay plain decode's either way."""
    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    config = engine_config(qpack, pool={"slots": 16}, compute={"speculative": "auto"})
    async with open_engine(config) as engine:
        plain = await _done(engine, GREEDY)
        policy = engine._core.batch.speculation
        for _ in range(40):  # another text's trials: all missed, dear ones
            policy.after_shadow(False, seconds=1.0)
        policy.after_plain(0.001)
        before = policy.stats.shadowed
        auto = msgspec.structs.replace(GREEDY, speculative="auto")
        dear = await _done(engine, auto)
        assert policy.stats.shadowed == before  # 1 s against 2 % of 12 x 1 ms: skipped
        policy.trial_s = 1e-5  # a trial as cheap as 1 % of a plain step
        cheap = await _done(engine, auto)
    assert dear.token_ids == cheap.token_ids == plain.token_ids
    assert policy.stats.shadowed == before + 1
    assert dear.stats.verify_passes == cheap.stats.verify_passes == 0


async def test_trials_of_a_backed_off_auto_run_beside_a_second_queued_step(synth_checkpoint, packed):
    """Every expert pooled, `auto` hopeless about the MTP head queues a second step at its
    plain steps (`compute.decode_ahead`); the trials due meanwhile catch the head up on
    the hidden states sunk so far, queued steps' included, and the tokens stay plain's."""
    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    config = engine_config(qpack, pool={"slots": 64}, memory={"embedding": "resident"},
                           compute={"speculative": "auto", "decode_ahead": "on"})
    long = msgspec.structs.replace(GREEDY, max_tokens=40)
    async with open_engine(config) as engine:
        await engine.warm()
        plain = await _done(engine, long)
        policy = engine._core.batch.speculation
        for _ in range(40):  # another text's trials: all missed, each as cheap as 1 % of a step
            policy.after_shadow(False, seconds=1e-5)
        policy.after_plain(0.001)
        before, counters = policy.stats.shadowed, engine.counters()
        auto = await _done(engine, msgspec.structs.replace(long, speculative="auto"))
        spent = engine.counters() - counters
    assert auto.token_ids == plain.token_ids and auto.stats.verify_passes == 0
    assert policy.stats.shadowed >= before + 2  # the new text's, then one due (8+ steps apart)
    assert spent.ahead_steps > 0 and spent.run_ahead_misses == 0


async def test_a_4_bit_model_streams_its_8_bit_head_through_the_same_reader(synth_checkpoint, packed):
    """The head's blobs are larger than the layers' (8 bits against 4): the reader's
    buffers hold them, and the tokens are still plain decode's."""
    qpack = packed(synth_checkpoint("qwen3_5_moe", dtype="bfloat16"), bits=4)
    plain, spec, counts = await _plain_and_mtp(qpack, pool={"slots": 8, "mtp_slots": 4},
                                               compute={"run_ahead": "off"})
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafts_proposed > 0 and counts.evictions > 0


async def test_a_container_packed_before_drafts_with_its_resident_head_the_same_drafts(
        synth_checkpoint, packed, tmp_path):
    src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    legacy = legacy_container(src, qpack, tmp_path / "legacy.qpack")
    pool = {"slots": 16, "mtp_slots": 4}
    plain, streamed, _ = await _plain_and_mtp(qpack, pool=pool)
    old_plain, resident, counts = await _plain_and_mtp(legacy, pool=pool)
    assert counts is None  # no pool: its experts came with the head
    assert resident.token_ids == old_plain.token_ids == plain.token_ids == streamed.token_ids
    # The same drafts, so the same passes and acceptance.
    for field in ("verify_passes", "drafts_proposed", "drafts_accepted"):
        assert getattr(resident.stats, field) == getattr(streamed.stats, field), field


async def test_the_engine_counts_the_heads_dense_part_and_its_pool_within_the_budget(
        synth_checkpoint, packed, tmp_path):
    src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    legacy = legacy_container(src, qpack, tmp_path / "legacy.qpack")
    facts = {}
    for name, path, mode in (("off", qpack, "off"), ("mtp", qpack, "mtp"), ("legacy", legacy, "mtp")):
        config = engine_config(path, pool={"slots": None, "budget_mb": 4},
                               compute={"speculative": mode})
        async with open_engine(config) as engine:
            core = engine._core
            experts = core.mtp.experts if core.mtp is not None else None
            facts[name] = (core.facts.dense_bytes, core.storage.nbytes,
                           experts.nbytes if experts else 0, core.storage.layout.slot_nbytes)
    dense_off, pool_off, _, slot = facts["off"]
    dense, pool, head_pool, _ = facts["mtp"]
    # The head's dense part is counted, not its experts (they are in the pool's bytes).
    assert dense - dense_off == (qpack / MTP_FILE).stat().st_size
    assert facts["legacy"][0] - dense_off == (legacy / MTP_FILE).stat().st_size > dense - dense_off
    assert facts["legacy"][2] == 0
    # One budget: the model's pool gave the head's its bytes.
    assert head_pool > 0 and pool + head_pool <= 4 * 2**20
    assert pool == pool_off - -(-head_pool // slot) * slot


async def test_a_memory_budget_counts_the_heads_dense_part_and_holds_both_pools(
        synth_checkpoint, packed):
    from pipeline.resident_map import current_rss_mb

    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    budget = int(current_rss_mb()) + 200
    memory = {"budget_mb": budget, "state_mb": 1, "temporaries_mb": 32}
    cfg = engine_config(qpack, pool={"slots": None}, memory=memory, compute={"speculative": "mtp"})
    async with open_engine(cfg) as engine:
        core = engine._core
        plan = engine.memory_plan
        assert plan is not None
        assert plan.dense_mb * 2**20 == core.facts.dense_bytes  # the head's dense part in it
        # The reader's buffers hold the head's blobs too (their stride, not the layers').
        assert plan.staging_mb * 2**20 == core.router.reader.staging_bytes
        both = core.storage.nbytes + core.mtp.experts.nbytes
        assert both <= plan.pool_mb * 2**20
        assert (plan.process_mb + plan.dense_mb + plan.state_mb + plan.staging_mb
                + plan.temporaries_mb + plan.pool_mb) <= budget
        done = await _done(engine, msgspec.structs.replace(GREEDY, speculative="mtp"))
        assert done.stats.drafts_proposed > 0


async def test_steps_decoded_in_a_batch_reach_the_head_and_a_row_alone_again_drafts(
        synth_checkpoint, packed):
    """A drafting row joined by another decodes in the batch (its hidden states still fed
    to its head), then alone again drafts on: its head saw every position, no gap."""
    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    config = engine_config(qpack, pool={"slots": 16, "mtp_slots": 4},
                           compute={"speculative": "mtp", "max_batch": 2})
    long = msgspec.structs.replace(GREEDY, max_tokens=20, speculative="mtp")
    short = msgspec.structs.replace(GREEDY, max_tokens=4, speculative="mtp")
    other = [5, 6, 7, 8, 9]
    async with open_engine(config) as engine:
        want_long = (await _done(engine, msgspec.structs.replace(long, speculative="off"))).token_ids
        events = [e async for e in engine.generate(other, msgspec.structs.replace(short, speculative="off"))]
        want_short = events[-1].token_ids
        engine.prefix_cache.clear()  # a resumed prompt's cached positions never reach the head
        got: dict[str, Any] = {}
        drafter: list[Any] = []

        async def run_short() -> None:
            got["short"] = [e async for e in engine.generate(other, short)][-1]

        async with trio.open_nursery() as nursery:
            tokens = 0
            async for e in engine.generate(list(PROMPT), long):
                tokens += len(getattr(e, "token_ids", ()))
                if isinstance(e, Done):
                    got["long"] = e
                elif tokens == 3 and not drafter:
                    members = engine._core.batch.members
                    drafter.append(members[0].speculation.drafter)
                    nursery.start_soon(run_short)
        assert engine.largest_batch == 2
        assert got["long"].token_ids == want_long and got["short"].token_ids == want_short
        head = drafter[0]
        # Every position through the head's own cache, up to the last drafts it made.
        assert head.cache.offset == head.done >= len(PROMPT) + 20 - 5


async def test_a_damaged_head_expert_fails_the_request_naming_its_file(synth_checkpoint, packed,
                                                                        tmp_path):
    from pipeline.container_damage import ContainerDamaged
    from qpack import spec

    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    copy = tmp_path / "damaged.qpack"
    shutil.copytree(qpack, copy)
    with Container.open(copy) as c:
        entry = c.manifest.mtp_experts
    with open(copy / spec.MTP_EXPERTS_FILE, "r+b") as f:  # a flipped byte in every expert
        for e in range(entry.num_experts):
            f.seek(e * entry.stride + 100)
            byte = f.read(1)
            f.seek(e * entry.stride + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    config = engine_config(copy, pool={"slots": 16}, compute={"speculative": "mtp"})
    async with open_engine(config) as engine:
        with pytest.raises(ContainerDamaged, match=r"expert \d+ of the MTP head failed its checksum") as info:
            await _done(engine, msgspec.structs.replace(GREEDY, speculative="mtp"))
        assert "\n" not in str(info.value)
        # Plain decode never reads the head: the rest of the container still serves.
        assert (await _done(engine, GREEDY)).token_ids
