"""Decode tokens queued whole, each MoE layer waiting for the host's slots (actors/awaited.py,
actors/device_wait.py), with the wait emulated on the MLX thread (`compute.device_wait =
"emulate"`: the same mailboxes and host protocol as the GPU kernel's, on MLX's CPU backend).
The tokens and log-probabilities equal stepping layer by layer; a read that fails mid-token
fails the request in one error and the engine serves the next; a request cancelled while a
token waits on a slow disk leaves the pool clean; off CUDA, "auto" declines. (The GPU's
kernel itself is checked on the device: benchmarks/device_wait_check.py.)"""

from __future__ import annotations

import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from structlog.testing import capture_logs

from actors.awaited import one_row, usable
from actors.device_wait import EXTRA_AT, IDS_AT, SEQ_WORD, HostWait
from actors.prefetch.strategies import NoPrefetch
from actors.reader import ExpertReadError
from actors.sampling_params import SamplingParams
from pipeline.config.loading import config_from_dict
from pipeline.engine import Engine, open_engine
from pipeline.events import Done, TextDelta
from tests.faultio import FaultIO
from tests.test_faults_disk import assert_pool_clean

PROMPT = "Streams of experts"


@pytest.fixture(scope="module")
def tiny(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="float32"), bits=None)


def _config(path: Path, wait: str, strategy: str = "next-gate", run_ahead: str = "auto") -> Any:
    # The smallest workable pool (16 of 64 experts a layer): most decode tokens read.
    return config_from_dict({
        "model": {"path": str(path)}, "pool": {"slots": 16},
        "compute": {"prefill_chunk": 4, "device_wait": wait, "run_ahead": run_ahead},
        "prefetch": {"strategy": strategy, "depth": 2 if strategy == "lookahead" else 1},
        "reader": {"retries": 1, "retry_backoff_ms": 1.0},
    })


async def _run(engine: Engine, logprobs: bool, after_first: Any = None) -> tuple[tuple[int, ...], list[float]]:
    values: list[float] = []
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3 if logprobs else None)
    async with aclosing(engine.generate(PROMPT, params)) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                if after_first is not None:
                    after_first()
                    after_first = None
                for lp in event.logprobs or ():
                    values += [lp.logprob, *(p for _, p in lp.top)]
            if isinstance(event, Done):
                return event.token_ids, values
    raise AssertionError("no Done event")


@pytest.mark.parametrize("strategy", ["next-gate", "lookahead", "none"])
async def test_waited_tokens_equal_stepped_ones_bit_for_bit(tiny, strategy) -> None:
    runs = {}
    for wait in ("off", "emulate"):
        async with open_engine(_config(tiny, wait, strategy)) as engine:
            before = engine.counters()
            # With log-probabilities every decode token goes through `Compute.forward`;
            # without, the pipelined decoder runs ahead after hits and waits after misses.
            runs[wait] = (await _run(engine, True), (await _run(engine, False))[0])
            spent = engine.counters() - before
            assert (spent.awaited_tokens > 0) == (wait == "emulate"), spent
            # The reads a waiting token installs are copies made after its answers.
            assert (engine._core.router.stats.pulled > 0) == (wait == "emulate")
            # ... predicted ones listed as their read ended, before their layer was demanded.
            early = engine._core.router.stats.pulled_early
            assert (early > 0) == (wait == "emulate" and strategy != "none"), early
            # Layers with every expert in place when published: some, with predictions.
            assert spent.awaited_ready_layers <= spent.awaited_layers
            assert spent.awaited_ready_layers > 0 or wait == "off" or strategy == "none"
            assert wait == "emulate" or spent.awaited_ready_layers == 0
            waiter = engine._core.compute.device_wait
            # ... some of them while their layer still waited (listed as each read ended).
            assert wait == "off" or (isinstance(waiter, HostWait) and waiter.copied_waiting > 0)
            assert (spent.awaited_host_seconds > 0) == (spent.awaited_layers > 0) == (wait == "emulate")
            assert (spent.awaited_gap_seconds > 0) == (wait == "emulate")
            assert_pool_clean(engine)
    assert runs["emulate"] == runs["off"]
    assert len(runs["off"][0][1]) == 8 * 4  # a logprob and its top 3 per token: compared


async def test_a_read_failing_mid_token_fails_its_request_and_the_engine_serves_on(tiny) -> None:
    async with open_engine(_config(tiny, "off")) as engine:
        reference = await _run(engine, True)
    io = FaultIO(tiny)
    # No run-ahead: every decode token waits (a run-ahead that misses steps per layer).
    async with open_engine(_config(tiny, "emulate", run_ahead="off"), io=io) as engine:
        wait = engine._core.compute.device_wait
        assert isinstance(wait, HostWait)
        with pytest.raises(ExpertReadError, match="of layer 2"):
            await _run(engine, True, after_first=lambda: io.inject("eio", layer=2))
        assert wait.aborted(wait._seq)  # the token was given up, its waits released
        assert_pool_clean(engine)
        io.clear()
        engine.prefix_cache.clear()
        assert await _run(engine, True) == reference


async def test_a_request_cancelled_while_a_token_waits_on_a_slow_disk(tiny) -> None:
    io = FaultIO(tiny)
    async with open_engine(_config(tiny, "emulate", run_ahead="off"), io=io) as engine:
        reference = await _run(engine, True)
        engine.prefix_cache.clear()
        waited = engine.counters().awaited_tokens
        # A decode step is not interrupted (the batch task runs it; a row leaves between
        # steps): the token waiting on the slow reads ends, then the request goes.
        with trio.move_on_after(0.3) as scope:
            await _run(engine, True, after_first=lambda: io.inject("slow", delay_s=0.1))
        assert scope.cancelled_caught
        assert engine.counters().awaited_tokens > waited
        assert_pool_clean(engine)
        io.clear()
        engine.prefix_cache.clear()
        assert await _run(engine, True) == reference


async def test_a_token_short_of_staging_buffers_is_redone_per_layer(tiny) -> None:
    """Pulled installs keep their staging buffers until the GPU has made the copies (the
    next answer): a demand that finds none free gives the token up (`PullStarved`), and
    the token is stepped per layer instead, with the same tokens."""
    async with open_engine(_config(tiny, "off")) as engine:
        reference = await _run(engine, True)
    async with open_engine(_config(tiny, "emulate", run_ahead="off")) as engine:
        reader = engine._core.router.reader
        spare, reader.queue.free[:] = reader.queue.free[2:], reader.queue.free[:2]  # two buffers: a starved disk
        try:
            assert await _run(engine, True) == reference
        finally:
            reader.queue.free.extend(spare)
        assert engine._core.compute.stats.awaited_given_up > 0
        assert_pool_clean(engine)


async def test_an_engine_closed_while_a_token_waits_closes_at_once(tiny) -> None:
    """Closing the engine cancels the compute task mid-token: the token's waits give up
    (the MLX call returns), the copies it owed are made, and the close does not hang."""
    io = FaultIO(tiny)
    started = trio.Event()

    async def generate(engine: Engine) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        async with aclosing(engine.generate(PROMPT, params)) as events:
            async for _ in events:
                io.inject("slow", delay_s=0.05)
                started.set()

    with trio.fail_after(20), trio.CancelScope() as everything:
        async with open_engine(_config(tiny, "emulate", run_ahead="off"), io=io) as engine:
            wait = engine._core.compute.device_wait
            assert isinstance(wait, HostWait)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate, engine)
                await started.wait()
                while True:  # a layer published and not answered: its token waits on a read
                    seq = wait._seq
                    if any(wait.published(row, seq) and wait.box[wait._at(row) + 1] != seq
                           for row in range(wait.rows)):
                        break
                    await trio.sleep(0.0005)
                everything.cancel()
    assert everything.cancelled_caught
    assert wait.aborted(seq)  # its waits were given up, so the MLX call could return


@pytest.mark.usefixtures("info_logs")
async def test_auto_declines_off_cuda_and_says_why(tiny, synth_checkpoint, packed) -> None:
    with capture_logs() as logs:
        async with open_engine(_config(tiny, "auto")) as engine:
            assert engine._core.compute.device_wait is None
            assert engine._core.router.pull is None
    said = [e for e in logs if e["event"] == "engine.device_wait"]
    assert said and not said[0]["on"] and said[0]["declined"] == "no CUDA direct path", said
    # A 4-bit container's pool widens its scales on the CPU: "emulate" cannot copy its
    # blobs as they are, and says so rather than stepping silently.
    quantized = packed(synth_checkpoint("qwen3_next", dtype="bfloat16", bits=4))
    with capture_logs() as logs:
        async with open_engine(_config(quantized, "emulate")) as engine:
            assert engine._core.compute.device_wait is None
    said = [e for e in logs if e["event"] == "engine.device_wait"]
    assert said and said[0]["declined"] == "the pool widens the blobs' scales", said


def test_what_can_be_queued_whole() -> None:
    import mlx.core as mx

    assert one_row([[5]]) and one_row([5]) and one_row(mx.array([[5]]))
    assert not one_row([[5], [6]]) and not one_row(mx.array([[5], [6]]))
    assert usable(NoPrefetch())  # predicts in the prefetch task


def test_the_mailbox_protocol() -> None:
    box = HostWait(3)
    seq = box.next_seq()
    assert box.box[SEQ_WORD] == seq  # where the token's kernels read it
    r = box._at(1)
    assert not box.published(1, seq) and not box.aborted(seq)
    box.box[r : r + 4] = [seq, 0, 2, 1]  # as a wait publishes: seq, answered, ids, extra
    box.box[r + IDS_AT : r + IDS_AT + 2] = [7, 9]
    box.box[r + EXTRA_AT] = 5
    assert box.published(1, seq) and not box.published(0, seq)
    ids, extra = box.routed(1)
    assert ids.tolist() == [7, 9] and extra.tolist() == [5]
    copies = [(1 << 40, 1 << 33, 4096), (123, 456, 7)]
    box.append(1, copies[:1])
    box.append(1, copies[1:])  # listed as reads end: in order
    box.answer(1, seq, np.array([3, 4], dtype=np.int32))
    assert box.copies(1) == copies and box.box[r + 1] == seq
    with pytest.raises(ValueError, match="exceed the mailbox"):
        box.append(1, [(0, 0, 1)] * 5000)
    box.begin()  # the next token's lists start empty
    assert box.copies(1) == []
    box.abort(seq)
    assert box.aborted(seq) and not box.aborted(box.next_seq())


def test_gpu_clock_splits_a_tokens_waits() -> None:
    """The GPU's clock of a token's waits (published, answer seen, ended, per layer): its
    own work between layers and its copies after each answer; nothing from a token whose
    kernels did not write them (the emulated wait)."""
    from types import SimpleNamespace

    from actors.awaited import gpu_clock

    stats = SimpleNamespace(awaited_gpu_gap_seconds=0.0, awaited_tail_seconds=0.0,
                            awaited_gpu_look_seconds=0.0)
    ns = np.array([[1_000, 3_000, 3_500, 2_900], [4_500, 6_000, 6_200, 0],
                   [7_200, 9_000, 9_100, 8_000]], dtype=np.int64)
    gpu_clock(stats, ns)  # type: ignore[arg-type]
    assert stats.awaited_gpu_gap_seconds == pytest.approx((1_000 + 1_000) / 1e9)
    assert stats.awaited_tail_seconds == pytest.approx((500 + 200 + 100) / 1e9)
    assert stats.awaited_gpu_look_seconds == pytest.approx((100 + 1_000) / 1e9)  # the second: found at once
    gpu_clock(stats, np.zeros((3, 4), dtype=np.int64))
    assert stats.awaited_gpu_gap_seconds == pytest.approx(2_000 / 1e9)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl")
def test_fine_timer_slack_is_the_calling_threads() -> None:
    """The event loop's short polling sleeps (actors/awaited.py) sleep what they ask for:
    the thread that asks gets a 1 us timer slack, the others keep theirs."""
    import ctypes
    import ctypes.util
    import threading

    from actors.timer_slack import SLACK_NS, fine_timer_slack

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    get, put = 30, 29  # PR_GET_TIMERSLACK, PR_SET_TIMERSLACK
    slack: dict[str, int] = {}

    def fine() -> None:
        libc.prctl(put, ctypes.c_ulong(50_000), 0, 0, 0)  # Linux's default, whatever it inherited
        slack["ok"] = fine_timer_slack()
        slack["after"] = libc.prctl(get, 0, 0, 0, 0)

    mine = libc.prctl(get, 0, 0, 0, 0)
    thread = threading.Thread(target=fine)
    thread.start()
    thread.join()
    assert slack["ok"] and slack["after"] == SLACK_NS
    assert libc.prctl(get, 0, 0, 0, 0) == mine  # this thread's own is untouched
