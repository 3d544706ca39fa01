"""Quantized KV caches (`compute.kv_bits`, pipeline/models/kv_quant.py): the engine's
tokens and logits are mlx-lm's with its own `QuantizedKVCache` (bit for bit on MLX's CPU
backend), and everything that keeps or moves a state keeps a quantized one: the prefix
cache, its files, speculation's cut-back; a family or head size it cannot serve is
refused in one line."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import msgspec
import numpy as np
import pytest
import trio
from helpers_engine import engine_config, forward_logits, generate, greedy
from helpers_forward import Reference, greedy_reference
from mlx_lm.generate import maybe_quantize_kv_cache

from pipeline.config.errors import ConfigError
from pipeline.engine import open_engine
from pipeline.engine_hooks import emulate_drafts
from pipeline.events import Done
from pipeline.models.kv_quant import PROBE_CALLS, KVQuant, probe_kernels
from pipeline.prefix_disk import Damaged, encode_state, load_state, read_header
from pipeline.speculation import EmulatedDrafts

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]  # odd: chunks of 2, then 1
DECODE = (3, 141, 59, 26, 5)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def kv_pair(synth_checkpoint, packed) -> tuple[Path, Path]:
    """tiny-kv (heads 64 wide), fp32, packed keeping fp32 experts (as tiny_pair's None)."""
    src = synth_checkpoint("qwen3_next", preset="tiny-kv")
    return src, packed(src, bits=16)


def _reference(src: Path, bits: int, prompt: list[int] = PROMPT) -> tuple[list[int], list[np.ndarray]]:
    """mlx-lm's greedy tokens and its logits over `prompt` in chunks of 2 then DECODE, its
    caches quantized by its own conversion from the first token (`--quantized-kv-start 0`;
    0 bits: not quantized)."""
    ref = Reference(src)
    original = ref.make_cache

    def make_cache() -> list:
        cache = original()
        if bits:
            maybe_quantize_kv_cache(cache, 0, 64, bits)
        return cache

    ref.make_cache = make_cache  # type: ignore[method-assign]
    tokens = greedy_reference(ref, prompt, MAX_TOKENS, set(), chunk=2)
    cache = make_cache()
    logits = [np.array(ref.logits(prompt[i : i + 2], cache)) for i in range(0, len(prompt), 2)]
    logits += [np.array(ref.logits([t], cache)) for t in DECODE]
    return tokens, logits


@pytest.mark.parametrize("bits", [4, 8])
async def test_tokens_and_logits_are_mlx_lms_with_its_quantized_cache(kv_pair, bits):
    src, qpack = kv_pair
    want_tokens, want_logits = _reference(src, bits)
    plain_tokens, plain_logits = _reference(src, 0)
    async with open_engine(engine_config(qpack, compute={"kv_bits": bits}, pool={"slots": 32})) as engine:
        cache = engine._core.model.make_cache()
        assert type(cache[3]).__name__ == "QuantizedKVCache" and cache[3].bits == bits
        assert engine.facts.context_limit > 0
        done = await generate(engine, PROMPT, MAX_TOKENS)
        eos = set(engine.tokenizer.eos_token_ids)
        cut = next((i + 1 for i, t in enumerate(want_tokens) if t in eos), len(want_tokens))
        assert list(done.token_ids) == want_tokens[:cut]
        got = await forward_logits(engine, PROMPT, DECODE)
        for i, (a, b) in enumerate(zip(got, want_logits, strict=True)):
            assert np.array_equal(a, b), f"forward {i}"
        # The quantization was in force: the unquantized model's logits differ.
        assert not all(np.array_equal(a, b) for a, b in zip(got, plain_logits, strict=True))
        assert plain_tokens  # (the reference ran)

        # A re-sent prompt resumes from the prefix cache's quantized state: the same tokens.
        again = await generate(engine, PROMPT, MAX_TOKENS)
        assert again.stats.cached_tokens > 0 and again.token_ids == done.token_ids
        # Speculation cuts a quantized cache back as a plain one: drafts from this run's
        # own tokens, a fifth of them wrong (random weights never repeat), give its tokens.
        emulate_drafts(engine, EmulatedDrafts(done.token_ids, 0.8, seed=1))
        try:
            spec = await generate_with(engine, msgspec.structs.replace(
                greedy(MAX_TOKENS), speculative="ngram"))
        finally:
            emulate_drafts(engine, None)
        assert spec.token_ids == done.token_ids
        assert 0 < spec.stats.drafts_accepted < spec.stats.drafts_proposed  # cut back too

        # The state a context costs: its attention layers' share at 4 or 8 bits.
        model = engine._core.model
        quantized = model.state_bytes(4096)
        model.kv_quant = None
        try:
            full = model.state_bytes(4096)
        finally:
            model.kv_quant = KVQuant(bits, 64)
        assert quantized < full


async def generate_with(engine, params) -> Done:
    events = [e async for e in engine.generate(PROMPT, params)]
    assert isinstance(events[-1], Done)
    return events[-1]


async def test_a_quantized_state_file_loads_back_only_into_the_same_cache(kv_pair, tmp_path):
    _src, qpack = kv_pair
    async with open_engine(engine_config(qpack, compute={"kv_bits": 4}, pool={"slots": 32})) as engine:
        model = engine._core.model
        cache = model.make_cache()
        async with engine._core.lock:
            await engine._core.compute.forward(PROMPT, cache, "prefill")

        def roundtrip() -> tuple[list, list]:
            path = tmp_path / "state.bin"
            path.write_bytes(b"".join(encode_state("fp", PROMPT, cache)))
            header, start = read_header(path)
            back = load_state(path, header, start, model.make_cache())
            model.kv_quant = KVQuant(8, 64)
            try:
                with pytest.raises(Damaged, match="4-bit KV state"):
                    load_state(path, header, start, model.make_cache())
            finally:
                model.kv_quant = KVQuant(4, 64)
            return cache, back

        cache, back = await engine._core.worker.run(roundtrip)
        q, r = cache[3], back[3]
        assert (r.offset, r.bits, r.group_size) == (q.offset, 4, 64) == (len(PROMPT), 4, 64)
        for a, b in zip([*q.keys, *q.values], [*r.keys, *r.values], strict=True):
            assert mx.array_equal(a[..., : q.offset, :], b).item()


async def test_a_family_or_head_size_it_cannot_serve_is_refused_in_one_line(
        synth_checkpoint, packed, kv_pair):
    gpt = packed(synth_checkpoint("gpt_oss"), bits=None)
    with pytest.raises(ConfigError, match="kv_bits = 4: gpt_oss's attention cannot"):
        async with open_engine(engine_config(gpt, compute={"kv_bits": 4})):
            pass
    _src, qpack = kv_pair
    with pytest.raises(ConfigError, match="heads are 16 wide, narrower than any"):
        tiny = packed(synth_checkpoint("qwen3_next"), bits=16)  # heads 16 wide
        async with open_engine(engine_config(tiny, compute={"kv_bits": 8})):
            pass



async def test_a_backend_without_the_quantized_kernels_is_refused_at_start_in_one_line(kv_pair):
    """On a GPU the engine runs the model's attention over a quantized cache at its head
    geometry before serving (MLX's CUDA backend lacks kernels for some shapes): here the
    probe itself, on the CPU, at the model's shapes, and with an attention that fails as
    CUDA's did."""
    _src, qpack = kv_pair
    async with open_engine(engine_config(qpack, compute={"kv_bits": 4})) as engine:
        model = engine._core.model
        quant = model.kv_quant
        assert quant == KVQuant(4, 64)
        seen: list[tuple[int, ...]] = []

        def attend(queries, keys, values, cache, scale, mask):
            from mlx_lm.models.base import scaled_dot_product_attention
            seen.append((queries.shape[2], keys[0].shape[2]))
            return scaled_dot_product_attention(queries, keys, values, cache, scale, mask)

        probe_kernels(quant, model.parts, model.compute_dtype(), attend)
        # Each call as a generation makes it: its new tokens over everything cached.
        ends = np.cumsum(PROBE_CALLS).tolist()
        assert seen == [(n, e) for n, e in zip(PROBE_CALLS, ends, strict=True)]

        def no_kernel(queries, keys, values, cache, scale, mask):
            if queries.shape[2] == 1:
                raise RuntimeError("[quantized_matmul] No implementation for\nproblem shape: 1x129x256x8")
            return attend(queries, keys, values, cache, scale, mask)

        with pytest.raises(ConfigError) as refused:
            probe_kernels(quant, model.parts, model.compute_dtype(), no_kernel)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("compute.kv_bits = 4: MLX ")
    assert "No implementation for problem shape: 1x129x256x8" in line and line.endswith("use 0")


@pytest.mark.parametrize(("compute", "counter"), [({"run_ahead": "on"}, "run_ahead_misses"),
                                                  ({"device_wait": "emulate"}, "awaited_tokens")])
async def test_a_token_undone_after_a_miss_restores_the_quantized_cache(kv_pair, compute, counter):
    # 8 slots: run-ahead tokens miss an expert and are redone from that layer on, the
    # caches put back from the snapshot (the quantized ones' offsets); waited tokens
    # (emulated) snapshot them the same way.
    src, qpack = kv_pair
    want, _ = _reference(src, 4)
    config = engine_config(qpack, compute={"kv_bits": 4, **compute})
    async with open_engine(config) as engine:
        done = await generate(engine, PROMPT, MAX_TOKENS)
        assert getattr(engine.counters(), counter) > 0
    eos = set(engine.tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
    assert list(done.token_ids) == want[:cut]


PROMPTS = {"a": [40, 1079, 264, 8, 3, 7000, 512], "b": PROMPT, "c": [5, 6, 7]}  # odd lengths


async def test_rows_decoded_together_get_the_tokens_each_gets_alone(kv_pair):
    # Rows of different lengths (left padding), one joining while two decode, rows
    # leaving as they end: the batched quantized cache's merge, extend, filter and extract.
    src, qpack = kv_pair
    want = {k: _reference(src, 4, p)[0] for k, p in PROMPTS.items()}
    config = engine_config(qpack, compute={"kv_bits": 4}, pool={"slots": 16},
                           reader={"concurrency": 4})
    async with open_engine(config) as engine:
        assert engine.max_batch == 4
        eos = set(engine.tokenizer.eos_token_ids)
        got: dict[str, Done] = {}
        a_decoding = trio.Event()

        async def run(name: str, after: trio.Event | None = None) -> None:
            if after is not None:
                await after.wait()
            events = []
            async for event in engine.generate(PROMPTS[name], greedy(MAX_TOKENS)):
                events.append(event)
                if len(events) == 3 and name == "a":
                    a_decoding.set()
            got[name] = events[-1]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a")
            nursery.start_soon(run, "b")
            nursery.start_soon(run, "c", a_decoding)
        assert engine.largest_batch >= 2
        for name, tokens in want.items():
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            assert list(got[name].token_ids) == tokens[:cut], name
