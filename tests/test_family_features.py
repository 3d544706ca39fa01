"""The engine's features on every family beyond the Qwen hybrids (issue 27, item 4): prefix
reuse over their plain (or latent) KV caches, exact speculative verify passes, and the
routing trace of what each step demanded, and calibrated routing (bench --routing), which
says that no routing statistics of these families are published and whose parameters it
borrows. Tiny fp32 checkpoints; references are the same engine's plain, cold runs (the
family tests compare those to mlx-lm)."""

from __future__ import annotations

import msgspec
import pytest
from helpers_engine import engine_config, generate
from helpers_forward import tiny_pair

from actors.sampling_params import SamplingParams
from pipeline.bench.routing import calibrate
from pipeline.engine import open_engine
from pipeline.engine_hooks import emulate_drafts
from pipeline.events import Done
from pipeline.speculation import EmulatedDrafts

FAMILIES = ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss"]  # gpt_oss: rings of a window of 4, wrapped
PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7]


@pytest.fixture(params=FAMILIES)
def container(request, synth_checkpoint, packed):
    return tiny_pair(synth_checkpoint, packed, request.param, None)[1]


async def _done(engine, prompt, params) -> Done:
    events = [e async for e in engine.generate(list(prompt), params)]
    assert isinstance(events[-1], Done)
    return events[-1]


async def test_prefix_reuse_speculation_and_routing_traces(container) -> None:
    config = engine_config(container, pool={"slots": 16}, compute={"run_ahead": "on"})
    async with open_engine(config, record_routing=True) as engine:
        # Prefix reuse: a re-sent prompt resumes from its cached state, the same tokens;
        # a follow-up with a new ending reuses the shared start.
        cold = await generate(engine, PROMPT, 6)
        again = await generate(engine, PROMPT, 6)
        assert cold.stats.cached_tokens == 0
        assert again.stats.cached_tokens == len(PROMPT) - 1 and again.token_ids == cold.token_ids
        other = PROMPT + [11, 12]
        reused = await generate(engine, other, 4)
        assert reused.stats.cached_tokens == len(PROMPT) - 1
        engine.prefix_cache.clear()
        assert (await generate(engine, other, 4)).token_ids == reused.token_ids

        # Speculation: verify passes over emulated drafts (some kept, some rejected) give
        # plain decode's greedy tokens.
        engine.prefix_cache.clear()
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        plain = (await _done(engine, PROMPT, greedy)).token_ids
        engine._core.batch.speculation.max_draft = 2
        emulate_drafts(engine, EmulatedDrafts(plain, 0.6, seed=2))
        engine.prefix_cache.clear()
        spec = await _done(engine, PROMPT, msgspec.structs.replace(greedy, speculative="ngram"))
        assert spec.token_ids == plain
        s = spec.stats
        assert s.verify_passes > 0 and 0 < s.drafts_accepted < s.drafts_proposed

        # The routing trace: every MoE layer of every step, each pass's union demanded once.
        await engine._core.compute.prefetcher.caught_up()
        recorder = engine._core.compute.recorder
        assert recorder is not None
        steps = recorder.trace.steps
        moe = engine._core.model.moe_layers
        assert steps and all([e.layer for e in st.layers] == moe for st in steps)
        passes = [st for st in steps if st.phase == "decode" and len(st.layers[0].observed()) > 1]
        assert passes
        for st in passes:
            for entry in st.layers:
                assert entry.chosen == list(dict.fromkeys(e for row in entry.observed() for e in row))

        # Calibrated routing (benchmark only) with the emulated gate: none of these
        # families has published router statistics, and the label on every row says so.
        model_type = engine.facts.model_type
        override = calibrate(engine, "calibrated-gate", seed=0)
        assert f"borrowed: no published routing statistics for {model_type}" in override.label
        assert "calibrated-model qwen3.5-397b parameters" in override.label
        engine.prefix_cache.clear()
        assert len((await generate(engine, PROMPT, 3)).token_ids) == 3
