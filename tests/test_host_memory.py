"""`resident_map` (where RSS lives) and `heap_trim` (freed arena memory back to the OS),
measured in fresh subprocesses so the numbers are the script's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.resident_map import current_rss_mb, resident_by_mapping, resident_kinds

ROOT = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _run(script: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_only
def test_the_map_accounts_for_the_rss_total():
    by_mapping = resident_by_mapping(top=1000)
    kinds = resident_kinds()
    assert set(kinds) == {"RssAnon", "RssFile", "RssShmem"}
    assert sum(by_mapping.values()) == pytest.approx(current_rss_mb(), rel=0.05)
    assert sum(kinds.values()) == pytest.approx(current_rss_mb(), rel=0.05)


@linux_only
def test_a_touched_anonymous_buffer_shows_up_as_anon():
    r = _run("""
        import json, numpy as np
        from pipeline.resident_map import resident_by_mapping, resident_kinds
        before, kinds0 = resident_by_mapping(100), resident_kinds()
        a = np.ones(200 * 2**20, dtype=np.uint8)  # 200 MiB, every page written
        after, kinds1 = resident_by_mapping(100), resident_kinds()
        print(json.dumps({"anon": after["[anon]"] - before.get("[anon]", 0),
                          "kind": kinds1["RssAnon"] - kinds0["RssAnon"]}))
    """)
    assert r["anon"] >= 195 and r["kind"] >= 195


@linux_only
def test_trim_returns_freed_heap_pages_and_only_when_rss_grew():
    # 64 KiB chunks come from the heap (below glibc's mmap threshold). Every other one
    # stays alive, so the freed half is holes the heap cannot shrink past by itself.
    r = _run("""
        import json
        from pipeline.heap_trim import HeapTrimmer
        from pipeline.resident_map import current_rss_mb
        trimmer = HeapTrimmer()
        idle = trimmer.maybe_trim()
        chunks = [b"\\x01" * (64 * 1024) for _ in range(10000)]
        grown = current_rss_mb()
        del chunks[::2]
        freed = current_rss_mb()
        given = trimmer.maybe_trim()
        print(json.dumps({"idle": idle, "grown": grown, "freed": freed, "given": given,
                          "after": current_rss_mb(), "again": trimmer.maybe_trim(),
                          "total": trimmer.trimmed_mb}))
    """)
    assert r["idle"] == 0.0  # nothing grew: no walk over the arenas
    assert r["freed"] > r["grown"] - 50, "the heap shrank without a trim: the test proves nothing"
    assert r["given"] >= 250 and r["after"] < r["freed"] - 250
    assert r["again"] == 0.0 and r["total"] == r["given"]


@linux_only
def test_trim_returns_a_servers_holes_when_a_generation_ends_alone():
    # A server's steady state (pipeline/heap_trim.py): holes of freed buffers in the
    # arenas, RSS up by far less than GROWTH_MB (soaks rose 200-450 MiB/hour waiting for
    # it). 160 MiB of 64 KiB chunks, every other one freed: kept while other generations
    # run (what they hold would set the floor), given back once one ends alone.
    r = _run("""
        import json
        from pipeline.heap_trim import GROWTH_MB, IDLE_GROWTH_MB, HeapTrimmer
        from pipeline.resident_map import current_rss_mb
        trimmer = HeapTrimmer()
        start = current_rss_mb()
        chunks = [b"\\x01" * (64 * 1024) for _ in range(2560)]
        del chunks[::2]
        freed = current_rss_mb()
        busy = trimmer.maybe_trim(alone=False)
        given = trimmer.maybe_trim(alone=True)
        print(json.dumps({"grew": freed - start, "busy": busy, "given": given, "after": current_rss_mb(),
                          "freed": freed, "again": trimmer.maybe_trim(alone=True),
                          "rule": GROWTH_MB, "idle_rule": IDLE_GROWTH_MB}))
    """)
    assert r["idle_rule"] <= r["grew"] < r["rule"]
    assert r["busy"] == 0.0
    assert r["given"] >= 60 and r["after"] < r["freed"] - 60
    assert r["again"] == 0.0  # the trim's result is the new floor: no second walk


@linux_only
def test_a_cancelled_generation_that_leaves_the_engine_idle_gives_the_holes_back(tiny_bench: Path):
    # Soaks' clients go away mid-generation; such a generation never reached its own end,
    # so until the compute task's `on_idle` its holes stayed (the soak's slope FAILed).
    # 160 MiB of 64 KiB chunks, every other one freed, then a generation cancelled after
    # its first text: the engine, idle again, hands them back.
    r = _run(f"""
        import json, trio
        from actors.sampling_params import SamplingParams
        from pipeline.config.loading import config_from_dict
        from pipeline.engine import open_engine
        from pipeline.resident_map import current_rss_mb

        async def main():
            config = config_from_dict({{"model": {{"path": {str(tiny_bench)!r}}},
                                        "pool": {{"slots": 64}}}})
            async with open_engine(config) as engine:
                chunks = [b"\\x01" * (64 * 1024) for _ in range(2560)]
                del chunks[::2]
                freed = current_rss_mb()
                events = 0
                with trio.move_on_after(60) as scope:
                    async for _ in engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=200)):
                        events += 1
                        scope.cancel()  # the client goes away after the first event
                while engine.trimmed_mb == 0 and engine.busy:
                    await trio.sleep(0.01)
                with trio.move_on_after(10):
                    while engine.trimmed_mb == 0:
                        await trio.sleep(0.01)
                print(json.dumps({{"events": events, "freed": freed, "after": current_rss_mb(),
                                  "given": engine.trimmed_mb,
                                  "generations": engine.generations}}))

        trio.run(main)
    """)
    assert r["events"] == 1 and r["generations"] == 1
    assert r["given"] >= 60 and r["after"] < r["freed"] - 60
