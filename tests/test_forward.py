"""The streamed forward pass against mlx-lm running the same checkpoint fully resident.

Our side is driven by hand (tests/helpers_forward.py: dense core + pool slots, experts
read from the container and placed by a seeded random slot manager), so every layer's
output can be compared; the engine is used for the greedy-decode checks and the
pool-size refusal.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from helpers_engine import engine_config
from helpers_forward import (
    FAMILIES,
    DirectForward,
    Reference,
    greedy_reference,
    max_abs,
    reference_for,
    tiny_pair,
)

from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.engine_sizing import PoolTooSmall
from pipeline.events import Done

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]
TOLERANCE = {None: 1e-4, 4: 2e-3, 8: 2e-3}


@pytest.fixture
def pair(synth_checkpoint, packed):
    def get(family: str, bits: int | None = None) -> tuple[Path, Path]:
        return tiny_pair(synth_checkpoint, packed, family, bits)

    return get


@pytest.fixture
def bits() -> int | None:
    """The container's bits for a test that does not choose them (parametrize overrides it)."""
    return None


@pytest.fixture
def ref(pair, family, bits) -> Reference:
    """mlx-lm's model for (family, bits), loaded once per session in the set-up of the first
    test that needs it (not in that test's call, where it would pass for the test's time)."""
    src, _ = pair(family, bits)
    return reference_for(src, bits)


@pytest.mark.parametrize("bits", [None, 4, 8], ids=["fp32", "q4", "q8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_and_the_logits_match_mlx_lm(pair, ref, family, bits):
    _src, qpack = pair(family, bits)
    ours = DirectForward(qpack, num_slots=16, seed=1)
    tol = TOLERANCE[bits]
    ours_cache, ref_cache = ours.make_cache(), ref.make_cache()
    # A prompt, then two decode steps on the caches it left: masks, KV and DeltaNet state.
    for tokens in (PROMPT, [5], [4242]):
        # Every position's layer outputs, the last position's logits.
        logits, layers = ours.forward(tokens, ours_cache, layer_outputs=True, all_positions=False)
        want_logits, want_layers = ref.forward(tokens, ref_cache, layer_outputs=True,
                                               all_positions=False)
        assert len(layers) == len(want_layers) == ours.model.num_layers
        for i, (got, want) in enumerate(zip(layers, want_layers, strict=True)):
            assert got.dtype == want.dtype
            assert max_abs(got, want) <= tol, f"layer {i} output, tokens {tokens}"
        assert max_abs(logits, want_logits) <= tol, f"logits, tokens {tokens}"
    # The layer-by-layer reference is mlx-lm's own __call__, read correctly.
    assert mx.array_equal(ref.logits(PROMPT, ref.make_cache()), ref.forward(PROMPT, ref.make_cache(), all_positions=False)[0][-1]).item()
    assert ours.installs > 0
    ours.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decode_equals_one_forward_over_all_tokens(pair, family):
    _src, qpack = pair(family)
    ours = DirectForward(qpack, seed=2)
    cache = ours.make_cache()
    ours.forward(PROMPT[:-4], cache)
    for token in PROMPT[-4:]:
        step_logits, _ = ours.forward([token], cache)
    full, _ = ours.forward(PROMPT, ours.make_cache())
    assert max_abs(step_logits[-1], full[-1]) <= 1e-4
    ours.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_token_by_token(pair, family):
    _src, qpack = pair(family)
    ours = DirectForward(qpack, seed=3)
    by_token = []
    cache = ours.make_cache()
    for token in PROMPT:
        by_token.append(ours.forward([token], cache)[0])
    want = mx.concatenate(by_token, axis=0)
    for chunk in (3, 5, len(PROMPT)):
        cache = ours.make_cache()
        parts = [ours.forward(PROMPT[i : i + chunk], cache)[0] for i in range(0, len(PROMPT), chunk)]
        got = mx.concatenate(parts, axis=0)
        assert max_abs(got, want) <= 1e-4, f"chunk {chunk}"
    ours.close()


def _run(qpack: Path, num_slots: int | None, seed: int, chunk: int) -> list[mx.array]:
    """The logits of each chunk of a chunked prefill of PROMPT (its last position, which
    every earlier one feeds), then of four decode steps."""
    ours = DirectForward(qpack, num_slots=num_slots, seed=seed)
    cache = ours.make_cache()
    out = [ours.forward(PROMPT[i : i + chunk], cache, all_positions=False)[0]
           for i in range(0, len(PROMPT), chunk)]
    for token in (3, 141, 59, 26):
        out.append(ours.forward([token], cache)[0])
    ours.close()
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [2, 16])
def test_logits_bit_identical_across_pool_sizes_and_slot_assignments(pair, family, chunk):
    """Smallest workable pool to every expert resident, slots scrambled by seed. A chunk of
    16 tokens routes 64 (token, expert) pairs, so mlx-lm's sorted gather path runs too."""
    bits = 4 if chunk == 16 else None  # both expert kernels: gather_qmm and gather_mm
    _src, qpack = pair(family, bits)
    smallest = min(16, min(chunk, len(PROMPT)) * 4)
    runs = [
        _run(qpack, num_slots, seed, chunk)
        for num_slots, seed in ((smallest, 0), (smallest + 5, 7), (None, 3))
    ]
    first = runs[0]
    for n, run in enumerate(runs[1:], start=1):
        assert len(run) == len(first)
        for i, (a, b) in enumerate(zip(first, run, strict=True)):
            assert mx.array_equal(a, b).item(), f"run {n}, forward {i}"


@pytest.mark.parametrize("family", FAMILIES)
async def test_engine_greedy_64_tokens_equal_mlx_lm_greedy(pair, ref, family):
    """The real engine, at its smallest workable pool (8 slots for chunks of 2 tokens)."""
    _src, qpack = pair(family)
    async with open_engine(engine_config(qpack)) as engine:
        eos = set(engine.tokenizer.eos_token_ids)
        want = greedy_reference(ref, PROMPT, 64, eos, chunk=2)
        events = [e async for e in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=64))]
        done = events[-1]
        assert isinstance(done, Done)
        assert list(done.token_ids) == want
        assert engine.facts.slots == 8


async def test_pool_too_small_is_refused_with_the_smallest_workable_size(pair):
    _src, qpack = pair("qwen3_next")
    # top_k 4: a prefill chunk of 3 tokens may need 12 distinct experts of one layer.
    with pytest.raises(PoolTooSmall, match=r"smallest workable pool is 12 slots"):
        async with open_engine(engine_config(qpack, pool={"slots": 11}, compute={"prefill_chunk": 3})):
            pass
    with pytest.raises(PoolTooSmall, match=r"smallest workable pool is 16 slots"):
        async with open_engine(engine_config(qpack, pool={"slots": 15}, compute={"prefill_chunk": 64})):
            pass
