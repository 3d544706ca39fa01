"""One total memory budget, and the parts it is made of held to their size (docs/memory.md).

Sizes are measured on the tiny containers in a fresh process (RSS is per process): the
tokenizer (the real 248k-token Qwen3.5 vocabulary), MLX's temporaries above dense +
pool + state, and no transformers import. The budget is checked through a real open.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
import trio
from helpers_engine import engine_config, forward_logits

from pipeline.cli.commands import budget_arg
from pipeline.config.schema import MemoryConfig
from pipeline.engine import open_engine
from pipeline.failures import one_line
from pipeline.memory_budget import AUTO_SHARE, PoolBudgetError, plan_memory
from pipeline.resident_map import current_rss_mb

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234, 999, 42, 7, 8, 6500]

# Measured 2026-12-03 on the 2-core VM (docs/memory.md): tokenizer 75 MiB for the 248k
# vocabulary with its library's import (its Rust object's floor is ~66 MiB of live heap;
# `Tokenizer.from_file` measured 97 here: its parse garbage left the object's pages
# scattered, pipeline/tokenizer_build.py); temporaries on the tiny model a few MiB. The
# bounds leave room for allocator noise, not for the library's own parse coming back, a
# Python copy of the vocabulary (+60 MiB and more) or a whole-pool cast (~the pool's
# scales again).
TOKENIZER_MAX_MB = 85
READERS = {"concurrency": 2}  # no queue-depth probe at open
TEMPORARIES_MAX_MB = 24

PROBE = r"""
import json, sys
import trio
import pipeline.engine as E
from actors.sampling_params import SamplingParams
from pipeline.config.loading import config_from_dict
from pipeline.resident_map import current_rss_mb
from pipeline.tokenizer import load_tokenizer
from qpack.reader import Container
import mlx.core as mx

path = sys.argv[1]
before = current_rss_mb()
load_tokenizer(Container.open(path, verify="off").tokenizer_dir())
tokenizer_mb = current_rss_mb() - before

async def main():
    cfg = config_from_dict({"model": {"path": path}, "pool": {"slots": 16},
                            "reader": {"concurrency": 2}})
    async with E.open_engine(cfg) as engine:
        base = mx.get_active_memory()  # dense + pool
        mx.reset_peak_memory()
        async for _ in engine.generate(list(range(100, 164)), SamplingParams(max_tokens=8, temperature=0)):
            pass
        state = engine._core.model.state_bytes(64 + 8)
        facts["on_file"] = engine._core.model.tokens_on_host
        facts["dense_held"] = engine.facts.dense_bytes < engine.container.manifest.dense_bytes
        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        facts["cache_limit"] = limit
        return (mx.get_peak_memory() - base - state) / 2**20

facts = {}
temporaries_mb = trio.run(main)
print(json.dumps({"tokenizer_mb": tokenizer_mb, "temporaries_mb": temporaries_mb,
                  "transformers": "transformers" in sys.modules, **facts}))
"""


@pytest.fixture(scope="module")
def qwen35(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_5_moe"), bits=4)


def test_tokenizer_and_temporaries_hold_their_size(qwen35: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE, str(qwen35)], capture_output=True,
                         text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert not sizes["transformers"], "an engine imported transformers (~210 MiB resident)"
    assert 0 < sizes["tokenizer_mb"] <= TOKENIZER_MAX_MB, sizes
    assert sizes["temporaries_mb"] <= TEMPORARIES_MAX_MB, sizes
    # The CPU backend's defaults without a budget (docs/memory.md): the token embedding on
    # file, MLX's cache at 8 MiB.
    assert sizes["on_file"] and sizes["dense_held"], sizes
    assert sizes["cache_limit"] == 8 << 20, sizes


MAPPED = r"""
import ctypes, sys
from pipeline.memory_malloc import map_large_blocks

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

info = ctypes.CDLL("libc.so.6").mallinfo2
info.restype = Info

def mapped():
    # Freeing a mapped 16 MiB block raises glibc's own threshold to 16 MiB; held, a 2 MiB
    # block is still a mapping of its own (unmapped when freed).
    big = bytearray(16 << 20)
    del big
    before = info().hblkhd
    block = bytearray(2 << 20)
    return info().hblkhd - before >= 2 << 20

held = sys.argv[1] == "held" and map_large_blocks()
print(held, mapped())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_of_a_mib_and_more_leave_at_once() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    # Each case in a fresh process: glibc's thresholds are per process.
    for case, want in (("glibc's own", ["False", "False"]), ("held", ["True", "True"])):
        out = subprocess.run([sys.executable, "-c", MAPPED, case], capture_output=True,
                             text=True, env=env, timeout=60, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == want, (case, out.stdout)


def test_a_budget_sizes_the_pool_and_too_small_is_refused_with_the_numbers(qwen35: Path) -> None:
    async def main() -> None:
        # What this test process already holds, plus room for a pool of some dozens of slots.
        budget = int(current_rss_mb()) + 160
        memory = {"budget_mb": budget, "state_mb": 1, "temporaries_mb": 32}
        cfg = engine_config(qwen35, pool={"slots": None}, memory=memory, reader=READERS)
        async with open_engine(cfg) as engine:
            plan = engine.memory_plan
            assert plan is not None and plan.budget_mb == budget
            # The tiny model's every expert fits: the pool holds them all, within the budget.
            cap = engine.container.manifest.num_experts * len(engine._core.model.moe_layers)
            assert engine._core.storage.num_slots == plan.slots == cap
            assert engine.pool_bytes == plan.pool_mb * 2**20
            parts = (plan.process_mb + plan.dense_mb + plan.state_mb + plan.staging_mb
                     + plan.temporaries_mb + plan.pool_mb)
            assert parts <= budget
            # The state reserve caps a request's context and the batch's state.
            # Half the state reserve caps a request's context and the batch's state, the
            # other half the prefix cache's copies.
            half = 2**19
            assert engine._core.model.state_bytes(engine.context_limit) <= half
            assert engine._core.model.state_bytes(engine.context_limit + 256) > half
            assert engine._core.compute_task.budget == half == engine.prefix_cache.max_bytes
        with pytest.raises(PoolBudgetError) as err:
            async with open_engine(engine_config(qwen35, pool={"slots": None}, reader=READERS,
                                                 memory={"budget_mb": 64})):
                pass
        line = one_line(err.value)
        assert line.startswith("memory budget of 64 MiB is too small: the process"), line
        assert "raise --memory-mb (memory.budget_mb) to at least" in line and "\n" not in line

    trio.run(main)


@pytest.mark.parametrize("given", ["auto", None])
def test_an_auto_budget_is_the_process_and_most_of_the_memory_available(qwen35: Path, given: str | None) -> None:
    """"auto" given, or nothing (the default on the CPU backend without a pool size)."""
    async def main() -> None:
        cfg = engine_config(qwen35, pool={"slots": None}, memory={"budget_mb": given},
                            reader=READERS)
        low = current_rss_mb() + AUTO_SHARE * psutil.virtual_memory().available / 2**20
        async with open_engine(cfg) as engine:
            plan = engine.memory_plan
            assert plan is not None
            # Measured at open: what the process held then, and 80% of what was available
            # (the tiny engine's own parts arrived in between: a loose bound).
            assert 0.9 * low <= plan.budget_mb <= 1.1 * low + 256, (plan.budget_mb, low)
            assert engine._core.storage.num_slots == plan.slots

    assert budget_arg("auto") == "auto" and budget_arg("4096") == 4096 and budget_arg("off") == "off"
    trio.run(main)


def test_a_pool_size_or_off_opens_without_the_default_budget(qwen35: Path) -> None:
    async def main() -> None:
        for pool, memory in (({"slots": 16}, {}), ({"slots": None, "budget_mb": 4}, {}),
                             ({"slots": None}, {"budget_mb": "off"})):
            cfg = engine_config(qwen35, pool=pool, memory=memory, reader=READERS)
            async with open_engine(cfg) as engine:
                assert engine.memory_plan is None, (pool, memory)

    trio.run(main)


def test_a_default_budget_too_small_says_so_and_how_to_set_another() -> None:
    sizes = {"process_bytes": 300 << 20, "dense_bytes": 1 << 30, "slot_nbytes": 2 << 20,
             "stride": 2 << 20, "readers": 2, "need_slots": 8, "max_slots": 1000}
    with pytest.raises(PoolBudgetError) as err:
        plan_memory(MemoryConfig(budget_mb=1200), default=True, **sizes)
    line = one_line(err.value)
    assert line.startswith("the default memory budget of 1,200 MiB (what the process holds plus 80% "
                           "of the memory available) is too small: the process"), line
    assert line.endswith("or --pool-mb, or --memory-mb off for no budget") and "\n" not in line


@pytest.mark.parametrize("state_mb", [0, 100])
def test_the_budget_a_refusal_names_is_enough_and_an_explicit_pool_holds_no_more_than_every_expert(
        state_mb: int) -> None:
    """The budget named is the smallest that opens (the state reserve, an eighth of the
    budget unless memory.state_mb says, grows with it), written as the flag takes it; a
    --pool-mb beyond every expert is cut to them, as without a budget."""
    import re

    sizes = {"process_bytes": 300 << 20, "dense_bytes": 1 << 30, "slot_nbytes": 2 << 20,
             "stride": 2 << 20, "readers": 2, "need_slots": 8, "max_slots": 100}
    mem = MemoryConfig(budget_mb=1200, state_mb=state_mb)
    with pytest.raises(PoolBudgetError) as err:
        plan_memory(mem, **sizes)
    match = re.search(r"to at least (\d+) or", one_line(err.value))
    assert match, one_line(err.value)
    enough = int(match[1])
    assert plan_memory(msgspec.structs.replace(mem, budget_mb=enough), **sizes).slots >= 8
    with pytest.raises(PoolBudgetError):
        plan_memory(msgspec.structs.replace(mem, budget_mb=enough - 1), **sizes)
    plan = plan_memory(msgspec.structs.replace(mem, budget_mb=4000), pool_bytes=1000 << 20, **sizes)
    assert plan.slots == 100 and plan.pool_mb == 200


def test_a_budget_that_cannot_hold_the_mtp_heads_pool_or_one_sequences_state_is_refused() -> None:
    from pipeline.engine_sizing import carve_head_pool
    from pipeline.memory_budget import check_state_fits
    from pipeline.memory_facts import MemoryPlan

    assert carve_head_pool(20, 8, 1 << 20, 4 << 20, budget_mb=1000) == 16
    assert carve_head_pool(10, 8, 1 << 20, 4 << 20) == 8  # no budget: the smallest pool
    with pytest.raises(PoolBudgetError, match="cannot hold the MTP head's pool"):
        carve_head_pool(10, 8, 1 << 20, 4 << 20, budget_mb=1000)
    plan = MemoryPlan(budget_mb=1000, process_mb=0, dense_mb=0, state_mb=64, staging_mb=0,
                      temporaries_mb=0, pool_mb=0, slots=0)
    check_state_fits(plan, lambda n: n * (1 << 20))
    with pytest.raises(PoolBudgetError, match="cannot hold one sequence's state"):
        check_state_fits(plan, lambda n: (40 << 20) + n)


def test_prefill_mixers_in_slices_compute_what_a_whole_chunk_does(qwen35: Path) -> None:
    async def main() -> None:
        cfg = engine_config(qwen35, pool={"slots": 64}, compute={"prefill_chunk": 13})
        async with open_engine(cfg) as engine:
            assert engine._core.model.slice_tokens >= 13  # the tiny dims fit a whole chunk
            whole = await forward_logits(engine, PROMPT, [3, 141])
            engine._core.model.slice_tokens = 4  # 4 + 4 + 4 + 1 tokens, caches carried between
            sliced = await forward_logits(engine, PROMPT, [3, 141])
        for a, b in zip(whole, sliced, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

    trio.run(main)


def test_prefill_moe_halves_in_slices_compute_what_a_whole_chunk_does(qwen35: Path) -> None:
    """Every token's MoE output is its own: slices of the chunk give the same logits, bit
    for bit on MLX's CPU, whether a slice takes mlx-lm's sorted path (>= 64 (token, expert)
    pairs: top-4 x 20 tokens) like the whole chunk or the unsorted one (4 tokens)."""
    prompt = (PROMPT * 4)[:40]

    async def main() -> None:
        cfg = engine_config(qwen35, pool={"slots": 64}, compute={"prefill_chunk": 40})
        async with open_engine(cfg) as engine:
            model = engine._core.model
            assert model.moe_slice_tokens >= 40  # the tiny dims fit a whole chunk
            runs = []
            for tokens in (model.moe_slice_tokens, 20, 4):
                model.moe_slice_tokens = tokens
                runs.append(await forward_logits(engine, prompt, [3, 141]))
        whole, *sliced = runs
        for run in sliced:
            for a, b in zip(whole, run, strict=True):
                np.testing.assert_array_equal(a, b)

    trio.run(main)


def test_a_long_chunks_moe_slices_fit_the_temporaries_share() -> None:
    """35B dims (top-8, hidden 2048, experts 512 wide): ~248 KiB a token in float32, so a
    1024-token chunk's MoE half runs in slices of ~350 tokens within 150 MiB."""
    from pipeline.prefill_slices import HEAD_RESERVE, moe_token_bytes, tokens_within

    per_token = moe_token_bytes(8, 2048, 512, 4)
    assert per_token == 8 * (3 * 2048 + 3 * 512) * 4 + 2048 * 4
    n = tokens_within(per_token, 150 * 2**20)
    assert n * per_token <= 150 * 2**20 - HEAD_RESERVE < (n + 1) * per_token
    assert 300 < n < 400 and tokens_within(per_token, 2**20) == 16  # never below MIN_SLICE
    # The chunk's own arrays (residual stream and the like, whole beside the slices) come
    # out of the share too: a 1024-token chunk at these dims holds 32 MiB of them.
    from pipeline.prefill_slices import residual_bytes

    chunk = residual_bytes(1024, 2048, 4)
    assert chunk == 32 * 2**20
    m = tokens_within(per_token, 150 * 2**20, chunk)
    assert m * per_token <= 150 * 2**20 - HEAD_RESERVE - chunk < (m + 1) * per_token
    assert 37.5 * 2**20 // per_token == tokens_within(per_token, 150 * 2**20, 10**9)  # a quarter at least


PRESSED = ("some avg10=35.20 avg60=12.00 avg300=3.10 total=9123456\n"
           "full avg10=4.00 avg60=1.00 avg300=0.20 total=812345\n")
CALM = ("some avg10=0.00 avg60=0.00 avg300=0.00 total=9123456\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=812345\n")


def test_the_pool_shrinks_under_memory_pressure_and_grows_back(qwen35: Path, tmp_path: Path) -> None:
    """The PSI file's format, read by the real parser; the engine generating throughout."""
    from helpers_engine import generate

    from pipeline.memory_pressure import CALM_POLLS, PoolAdapter, read_pressure

    psi = tmp_path / "memory"

    async def main() -> None:
        async with open_engine(engine_config(qwen35, pool={"slots": 64}, reader=READERS)) as engine:
            table = engine._core.router.table
            adapter = PoolAdapter(engine._core, floor_slots=8, read=lambda: read_pressure(psi))
            first = await generate(engine, PROMPT, 4)
            psi.write_text(PRESSED)
            for _ in range(20):  # an eighth per poll, down to the floor
                reading = await adapter.poll()
            assert reading is not None and reading.level == "pressed" and reading.some_avg10 == 35.2
            assert table.usable == 8 and len(table) <= 8
            shrunk = await generate(engine, PROMPT, 4)  # no failed request, same tokens
            assert shrunk.token_ids == first.token_ids and len(table) <= 8
            psi.write_text(CALM)
            for _ in range(CALM_POLLS * 8):
                await adapter.poll()
            assert table.usable == 64
            grown = await generate(engine, PROMPT, 4)
            assert grown.token_ids == first.token_ids

    trio.run(main)


def test_a_gpu_backends_deltanet_slices_count_every_array_a_step_holds() -> None:
    """35B dims (32 value heads of 128 x 128): the CPU frees a step's arrays as the next
    runs (one 2 MiB float32 state a token); a GPU backend keeps every op's inputs until its
    kernel has run, five state-sized arrays a step, so its slices are five times shorter
    (down to the 16-token floor)."""
    from types import SimpleNamespace

    from pipeline.prefill_slices import HELD_STEP_ARRAYS, MIN_SLICE, per_token_bytes, slice_tokens

    deltanet = SimpleNamespace(is_linear=True, linear_attn=SimpleNamespace(
        num_v_heads=32, head_v_dim=128, head_k_dim=128))
    attention = SimpleNamespace(is_linear=False, self_attn=SimpleNamespace(num_attention_heads=16))
    layers = [deltanet, deltanet, deltanet, attention]
    state = 32 * 128 * 128 * 4
    assert per_token_bytes(layers, 1024, held=False) == state
    assert per_token_bytes(layers, 1024, held=True) == HELD_STEP_ARRAYS * state
    share = 400 * 2**20
    cpu, gpu = (tokens_in(layers, share, held) for held in (False, True))
    assert cpu == (share - 64 * 2**20) // state and gpu == cpu // HELD_STEP_ARRAYS > MIN_SLICE
    assert slice_tokens(layers, 150 * 2**20, 1024) == tokens_in(layers, 150 * 2**20, False)  # the CPU here


def tokens_in(layers: list[object], share: int, held: bool) -> int:
    from pipeline.prefill_slices import per_token_bytes, tokens_within

    return tokens_within(per_token_bytes(layers, 1024, held=held), share)
