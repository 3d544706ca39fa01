"""Disk faults under a real engine: EIO, early EOF, short and slow reads, flipped bytes.

Faults are injected below the container (`tests.faultio.FaultIO` replaces the positional
read), so the container's crc check, the reader's retries, the router and the
generation's clean-up are the code under test. Transient faults must be invisible
(tokens equal a clean engine's); persistent ones fail that one request with an error
naming layer, expert and attempts, and leave the engine fully usable.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from actors.reader import ExpertReadError
from actors.sampling_params import SamplingParams
from pipeline.config.loading import config_from_dict
from pipeline.engine import Engine, open_engine
from pipeline.events import Done
from qpack import spec
from qpack.reader import Container, ExpertCorrupt, verify_container
from tests.faultio import FaultIO

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("Hello there", "The quick brown fox", "Streams of experts", "One two three four",
           "Disk faults", "Pool slots")
PARAMS = SamplingParams(temperature=0.0, max_tokens=5)
RETRIES = 2


@pytest.fixture(scope="session")
def tiny_qpack(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="float32"), bits=None)


def _config(path: Path, strategy: str = "next-gate", readers: int = 4):  # noqa: ANN202
    # The smallest workable pool (prefill_chunk * top_k = 16 of 64 experts): many reads.
    return config_from_dict({
        "model": {"path": str(path)},
        "pool": {"slots": 16},
        "compute": {"prefill_chunk": 4},
        "prefetch": {"strategy": strategy},
        "reader": {"retries": RETRIES, "retry_backoff_ms": 1.0, "concurrency": readers},
    })


async def _tokens(engine: Engine, prompt: str) -> tuple[int, ...]:
    async with aclosing(engine.generate(prompt, PARAMS)) as events:
        async for event in events:
            if isinstance(event, Done):
                return event.token_ids
    raise AssertionError("no Done event")


@pytest.fixture(scope="session")
def reference(tiny_qpack) -> dict[str, tuple[int, ...]]:
    """Greedy tokens of each prompt from a clean engine (no FaultIO at all)."""

    async def run() -> dict[str, tuple[int, ...]]:
        async with open_engine(_config(tiny_qpack)) as engine:
            return {p: await _tokens(engine, p) for p in PROMPTS}

    return trio.run(run)


def assert_pool_clean(engine: Engine) -> None:
    """Nothing left over from a failed or cancelled request."""
    snap = engine.pool_snapshot()
    table = engine._core.router.table
    assert snap["pinned"] == 0, snap
    assert snap["loads_in_flight"] == 0, snap
    assert [k for k in table.resident() if table.state(k) == "loading"] == []
    assert engine.waiting == 0
    assert not engine.busy


async def test_transient_faults_are_retried_and_invisible(tiny_qpack, reference):
    io = FaultIO(tiny_qpack)
    async with open_engine(_config(tiny_qpack), io=io) as engine:
        reader = engine._core.router.reader
        # flip first: a fresh engine has verified no expert yet, so every read is crc-checked.
        cases = [("flip", PROMPTS[0], True), ("eio", PROMPTS[1], True), ("eof", PROMPTS[2], True),
                 ("short", PROMPTS[3], False), ("slow", PROMPTS[4], False)]
        for kind, prompt, retried in cases:
            engine.prefix_cache.clear()
            retries0, failures0 = reader.stats.retries, reader.stats.failures
            # The same read fails RETRIES times in a row at worst: still within the budget.
            rule = io.inject(kind, times=RETRIES if retried else 40, delay_s=0.02, max_bytes=1000)
            assert await _tokens(engine, prompt) == reference[prompt], kind
            assert rule.hits == rule.times, (kind, rule)
            assert reader.stats.failures == failures0, kind
            assert (reader.stats.retries - retries0 == RETRIES) if retried else \
                reader.stats.retries == retries0, (kind, reader.stats)
            io.clear()


async def test_persistent_faults_fail_one_request_then_the_engine_recovers(tiny_qpack, reference):
    io = FaultIO(tiny_qpack)
    details = {"flip": "crc32", "eio": "Input/output error", "eof": "short read"}
    # What the user's line says for each (the detail stays in the cause chain and the log).
    says = {"flip": "failed its checksum: the container is damaged",
            "eio": "cannot be read from .*layer_003.bin: Input/output error: the disk or",
            "eof": "is cut short: .*layer_000.bin ends before it"}
    async with open_engine(_config(tiny_qpack), io=io) as engine:
        # flip first, on a layer no read has verified yet: verify="first-use" checks each
        # expert's crc once, so a flip in a later re-read of a verified expert is not seen.
        for (kind, layer), prompt in zip([("flip", 2), ("eio", 3), ("eof", 0)], PROMPTS, strict=False):
            engine.prefix_cache.clear()
            rule = io.inject(kind, layer=layer)
            with pytest.raises(ExpertReadError) as info:
                await _tokens(engine, prompt)
            assert re.match(rf"expert \d+ of layer {layer} {says[kind]}", str(info.value)), info.value
            cause = str(info.value.__cause__)
            assert f"of layer {layer}: read failed after {RETRIES + 1} attempts" in cause, cause
            assert details[kind] in cause, cause
            assert rule.hits >= RETRIES + 1
            assert_pool_clean(engine)
            io.clear()
            # The very next request (fault gone) is exactly a clean engine's.
            assert await _tokens(engine, prompt) == reference[prompt], kind


async def test_one_bad_expert_and_a_cancelled_slow_read(tiny_qpack, reference):
    io = FaultIO(tiny_qpack)
    async with open_engine(_config(tiny_qpack), io=io) as engine:
        # A persistent fault on a single expert fails only requests routed to it (a failed
        # prefetch of it is dropped silently); no request ever gets wrong tokens.
        io.inject("eio", layer=1, expert=0)
        outcomes = {}
        for prompt in PROMPTS:
            engine.prefix_cache.clear()
            try:
                outcomes[prompt] = await _tokens(engine, prompt) == reference[prompt]
            except ExpertReadError as exc:
                assert "expert 0 of layer 1" in str(exc)
                assert_pool_clean(engine)
                outcomes[prompt] = "failed"
        print("single bad expert:", outcomes)  # quoted by docs/reliability.md's table
        assert False not in outcomes.values(), outcomes
        assert {"failed", True} <= set(outcomes.values()), outcomes  # both kinds really happen
        io.clear()
        # A client that goes away while reads are in flight on a slow disk.
        io.inject("slow", delay_s=0.2)
        with trio.move_on_after(0.5) as scope:
            await _tokens(engine, PROMPTS[0])
        assert scope.cancelled_caught
        assert_pool_clean(engine)
        io.clear()
        engine.prefix_cache.clear()
        assert await _tokens(engine, PROMPTS[1]) == reference[PROMPTS[1]]


async def test_a_generation_ends_with_its_slow_mispredicted_reads_landed(tiny_qpack):
    """Reads ordered for experts the last layer then did not choose are still on a slow
    disk when the last token is drawn; the generation ends only once they have landed
    (installed for the next request), so an idle engine holds no read and no buffer."""
    io = FaultIO(tiny_qpack)
    async with open_engine(_config(tiny_qpack, "transition", readers=1), io=io) as engine:
        last = io.inject("slow", layer=engine.facts.moe_layers[-1], delay_s=0.02)
        for prompt in PROMPTS[:4]:  # from the third on, the transitions seen mispredict
            await _tokens(engine, prompt)
            assert_pool_clean(engine)
        assert last.hits > 0


@pytest.mark.parametrize("strategy", ["next-gate", "transition"])
async def test_predictions_a_slow_disk_could_not_reach_are_shelved_and_tokens_unchanged(
    tiny_qpack, reference, strategy,
):
    """One disk thread at 10 ms a read: the predictions for a layer are still queued when
    it is routed, and the ones it did not choose are shelved (actors/router.py). The
    tokens are a clean engine's, and the engine ends each generation with no read left."""
    io = FaultIO(tiny_qpack)
    async with open_engine(_config(tiny_qpack, strategy, readers=1), io=io) as engine:
        io.inject("slow", delay_s=0.01)
        for prompt in PROMPTS[:3]:
            engine.prefix_cache.clear()
            assert await _tokens(engine, prompt) == reference[prompt]
            assert_pool_clean(engine)
        assert engine._core.router.reader.stats.shelved > 0


async def test_going_idle_waits_for_a_hung_read_only_so_long(tiny_qpack):
    """A prefetched read that does not come back within `settle_timeout_s` is left for
    the next demand; one that does is installed, ready."""
    io = FaultIO(tiny_qpack)
    async with open_engine(_config(tiny_qpack), io=io) as engine:
        router = engine._core.router
        io.inject("slow", layer=1, expert=5, delay_s=0.5)
        router.settle_timeout_s = 0.05
        await router.prefetch([(1, [5])], engine._core.compute.tick)
        with trio.fail_after(0.4):
            await router.settle()
        assert engine.pool_snapshot()["loads_in_flight"] == 1
        assert router.table.state((1, 5)) == "loading"
        router.settle_timeout_s = 5.0
        await router.settle()
        assert engine.pool_snapshot()["loads_in_flight"] == 0
        assert router.table.state((1, 5)) == "ready"
        assert_pool_clean(engine)


def _flip_on_disk(root: Path, layer: int) -> None:
    entry = Container.open(root, verify="off").manifest.layer(layer)
    path = root / entry.file
    data = bytearray(path.read_bytes())
    for e in range(entry.num_experts):  # every expert of the layer: any route hits one
        data[e * entry.stride + 17] ^= 0x10
    path.write_bytes(bytes(data))


async def test_flipped_byte_on_disk_is_caught_before_use(tiny_qpack, tmp_path):
    copy = tmp_path / "flipped.qpack"
    shutil.copytree(tiny_qpack, copy)
    _flip_on_disk(copy, 1)
    async with open_engine(_config(copy)) as engine:
        with pytest.raises(ExpertReadError, match=r"of layer 1 failed its checksum: the container is "
                           rf"damaged; run moestream verify {re.escape(str(copy))}$") as info:
            await _tokens(engine, PROMPTS[0])
        assert "crc32" in info.value.damage.detail  # type: ignore[attr-defined]
        assert_pool_clean(engine)
        # Still refuses (never "verified" by a failed read), and still cleanly.
        with pytest.raises(ExpertReadError, match="failed its checksum"):
            await _tokens(engine, PROMPTS[1])
        assert_pool_clean(engine)
    report = verify_container(copy)
    assert len(report.problems) == 16 + 1, report.problems  # 16 experts + the file's sha256
    assert all("layer_001.bin" in p for p in report.problems)
    bad, good = _verify_cli(copy), _verify_cli(tiny_qpack)
    assert bad.returncode != 0
    assert "layer 1 expert 0: crc32" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    assert good.returncode == 0, good.stdout + good.stderr


def _verify_cli(path: Path) -> subprocess.CompletedProcess[str]:
    """`moestream verify PATH`, through the subcommand's own register()."""
    script = ("import argparse, sys\n"
              "from pipeline.cli.pack import register\n"
              "p = argparse.ArgumentParser(); register(p.add_subparsers())\n"
              "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    return subprocess.run([sys.executable, "-c", script, "verify", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_faultio_maps_reads_to_layer_and_expert(tiny_qpack):
    """The helper itself: a rule on (layer, expert) hits exactly that blob."""
    io = FaultIO(tiny_qpack)
    rule = io.inject("eio", layer=3, expert=5, times=1)
    with Container.open(tiny_qpack, io=io) as c:
        buf = bytearray(c.manifest.max_stride)
        c.read_expert(3, 4, buf)
        c.read_expert(2, 5, buf)
        with pytest.raises(OSError, match="Input/output error"):
            c.read_expert(3, 5, buf)
        c.read_expert(3, 5, buf)  # times=1: spent
    assert rule.hits == 1 and io.reads == 4
    assert (tiny_qpack / spec.layer_file(3)).is_file()


async def test_disk_fault_under_the_http_server_fails_one_request_then_serves(tiny_qpack):
    """Through `serve_engine`: a persistent fault is a server error (never a hang or a
    4xx), in a JSON body or, once a stream has started, as an in-stream error event."""
    import httpx2

    from pipeline.server.app import serve_engine
    from pipeline.server.settings import ServerSettings

    io = FaultIO(tiny_qpack)
    async with open_engine(_config(tiny_qpack), io=io) as engine, trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: serve_engine(
            engine, ServerSettings(port=0), task_status=task_status))
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            # Greedy: sampled, 2 % of replies ended at the end-of-text token before 3 tokens.
            request = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
            io.inject("eio", layer=2)
            resp = await http.post("/v1/completions", json=request)
            assert resp.status_code in (500, 503), resp.text
            assert resp.json()["error"]["type"] == "server_error"
            resp = await http.post("/v1/completions", json={**request, "stream": True})
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert resp.status_code == 200 and "error" in json.loads(events[-1]), events[-2:]
            assert_pool_clean(engine)
            io.clear()
            resp = await http.post("/v1/completions", json=request)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("verify, caught", [("first-use", False), ("always", True)])
def test_a_flip_on_a_re_read_is_caught_only_with_verify_always(tiny_qpack, verify, caught):
    """first-use trusts an expert once it passed; always checks every read (the known gap)."""
    io = FaultIO(tiny_qpack)
    with Container.open(tiny_qpack, verify=verify, io=io) as container:
        entry = container.manifest.layers[0]
        buf = bytearray(entry.stride)
        container.read_expert(entry.index, 0, buf)  # clean first read: passes its check
        io.inject("flip", layer=entry.index, expert=0, times=1)
        if caught:
            with pytest.raises(ExpertCorrupt, match=f"layer {entry.index} expert 0: crc32"):
                container.read_expert(entry.index, 0, buf)
        else:
            container.read_expert(entry.index, 0, buf)  # the flipped bytes go through
