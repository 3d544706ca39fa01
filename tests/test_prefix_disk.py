"""Prefix checkpoints on disk: written as a generation keeps them, reloaded by a new engine
(a restart) to the same tokens with the prompt's prefill skipped; damaged and stale
files are ignored with a log line and never loaded; the directory stays in its budget."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from helpers_engine import engine_config, generate
from structlog.testing import capture_logs

from pipeline.engine import open_engine
from pipeline.fingerprint import fingerprint
from pipeline.prefix_disk import SUFFIX, DiskPrefixCache, Header, encode_state, read_header

PROMPT = list(range(300, 340))  # 40 tokens


# The events checked here are info (tests/conftest.py: `info_logs`).
pytestmark = pytest.mark.usefixtures("info_logs")


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def _config(container: Path, where: Path, **server: object):
    return engine_config(container, pool={"slots": 16}, compute={"prefill_chunk": 8},
                         server={"prefix_cache_dir": str(where), "prefix_cache_min_tokens": 8,
                                 **server})


async def _first_run(container: Path, where: Path) -> list[int]:
    async with open_engine(_config(container, where)) as engine:
        cold = await generate(engine, PROMPT, 4)
        assert cold.stats.cached_tokens == 0
        engine.prefix_cache.flush()
    return list(cold.token_ids)


def _refingerprint(path: Path, other: str) -> None:
    """Rewrite a file's header as another container's (or version's) would be: valid, and
    not ours."""
    header, start = read_header(path)
    data = path.read_bytes()
    raw = msgspec.json.encode(msgspec.structs.replace(header, fingerprint=other))
    prefix = struct.pack("<4sIQI", b"MSPC", 1, len(raw), zlib.crc32(raw))
    path.write_bytes(prefix + raw + data[start:])


async def test_states_survive_a_restart(container: Path, tmp_path: Path) -> None:
    where = tmp_path / "prefixes"
    cold = await _first_run(container, where)
    files = sorted(where.glob(f"*{SUFFIX}"))
    # The prompt less its last token, the chunk boundaries past 8 tokens, and the end.
    assert len(files) >= 2
    assert all(p.name.startswith(fingerprint(container)) for p in files)
    assert not list(where.glob(".*.tmp"))
    async with open_engine(_config(container, where)) as engine:  # a restart
        with capture_logs() as logs:
            again = await generate(engine, PROMPT, 4)
        assert again.stats.cached_tokens == len(PROMPT) - 1 and list(again.token_ids) == cold
        assert any(e["event"] == "prefix_cache.disk_loaded" for e in logs)
        # A follow-up that repeats the reply goes on from the reply's end state.
        follow = await generate(engine, PROMPT + cold[:-1] + [5, 6], 2)
        assert follow.stats.cached_tokens == len(PROMPT) + len(cold) - 1


async def test_damaged_and_stale_files_are_never_loaded(container: Path, tmp_path: Path) -> None:
    where = tmp_path / "prefixes"
    cold = await _first_run(container, where)
    files = sorted(where.glob(f"*{SUFFIX}"))
    # The state a re-sent prompt would load is damaged, the others are another
    # container's, and one is torn: nothing is loadable.
    damaged = next(p for p in files if read_header(p)[0].tokens == tuple(PROMPT[:-1]))
    files.remove(damaged)
    files.append(damaged)
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0x40  # a flipped bit in the payload
    damaged.write_bytes(bytes(raw))
    for other in files[:-1]:
        _refingerprint(other, "fp_" + "0" * 16)
    (where / f"{fingerprint(container)}-torn{SUFFIX}").write_bytes(b"MSPC\x01")
    with capture_logs() as logs:
        async with open_engine(_config(container, where)) as engine:
            again = await generate(engine, PROMPT, 4)
    assert again.stats.cached_tokens == 0 and list(again.token_ids) == cold
    events = [e for e in logs if e["event"].startswith("prefix_cache.disk_")]
    reasons = " ".join(str(e.get("reason", "")) for e in events)
    assert "payload checksum mismatch" in reasons and "shorter than its header" in reasons
    assert sum(e["event"] == "prefix_cache.disk_stale" for e in events) == len(files) - 1
    assert not any(e["event"] == "prefix_cache.disk_loaded" for e in events)


async def test_the_directory_stays_within_its_budget(container: Path, tmp_path: Path) -> None:
    async with open_engine(engine_config(container, pool={"slots": 16})) as engine:
        cache = engine._core.model.make_cache()
        prompt = list(range(500, 520))
        await generate(engine, prompt, 1)
        state, _ = await engine._core.worker.run(engine.prefix_cache.take, prompt + [1])
        assert state is not None
        one = sum(map(len, await engine._core.worker.run(encode_state, "fp_test", prompt, state)))
        disk = DiskPrefixCache(tmp_path, "fp_test", engine._core.model.make_cache,
                               max_bytes=2 * one + one // 2, min_tokens=1)
        for i in range(4):
            await engine._core.worker.run(disk.put, [i, *prompt[1:]], state)
            disk.flush()
        names = sorted(p.name for p in tmp_path.glob(f"*{SUFFIX}"))
        assert len(names) == 2  # the two most recent
        reopened = DiskPrefixCache(tmp_path, "fp_test", engine._core.model.make_cache,
                                   max_bytes=10 * one, min_tokens=1)
        assert sorted(s[0] for s in reopened._index) == [2, 3]
        loaded, n = await engine._core.worker.run(reopened.take, [3, *prompt[1:], 9])
        assert n == len(prompt) and loaded is not None and len(loaded) == len(cache)
        for c in (disk, reopened):
            c.close()
        assert isinstance(read_header(tmp_path / names[0])[0], Header)


async def test_a_state_of_another_activation_dtype_is_stale(container: Path, tmp_path: Path) -> None:
    # The CPU's float32 states and a bfloat16 engine's differ in their bits: sharing a
    # directory, neither loads the other's (each would compute other logits than its own
    # prefill); the same dtype again loads them.
    where = tmp_path / "prefixes"
    await _first_run(container, where)
    config = engine_config(container, pool={"slots": 16},
                           compute={"prefill_chunk": 8, "dtype": "bfloat16"},
                           server={"prefix_cache_dir": str(where), "prefix_cache_min_tokens": 8})
    with capture_logs() as logs:
        async with open_engine(config) as engine:
            other = await generate(engine, PROMPT, 4)
    assert other.stats.cached_tokens == 0
    assert any(e["event"] == "prefix_cache.disk_stale" for e in logs)
    async with open_engine(_config(container, where)) as engine:
        again = await generate(engine, PROMPT, 4)
    assert again.stats.cached_tokens == len(PROMPT) - 1


def test_the_code_fingerprint_covers_every_forward_source_the_families_included() -> None:
    from pipeline.fingerprint import _sources

    names = [name for name, _ in _sources()]
    assert "streamed.py" in names and "families/base.py" in names and "families/qwen3_next.py" in names


def test_a_longer_file_wins_without_taking_the_shorter_match_in_memory(tmp_path: Path) -> None:
    """A lookup that a longer state on disk serves neither copies memory's shorter match
    nor marks it recently used (it did both before the file replaced it: the copy was
    thrown away, and the shorter state outlived entries used since)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    def state(n: int) -> list[KVCache]:
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
        return [c]

    tokens = list(range(1, 20))
    disk = DiskPrefixCache(tmp_path, "fp", lambda: [KVCache()], max_bytes=1 << 20,
                           min_tokens=8, max_entries=4)
    disk.put(tokens[:12], state(12))
    disk.flush()
    disk.clear()  # the longer state now only on disk
    disk.put(tokens[:4], state(4))  # shorter than min_tokens: memory only
    disk.put([7, 7], state(2))
    cache, cached = disk.take(tokens)
    assert cached == 12 and cache is not None and cache[0].offset == 12
    assert list(disk._entries) == [tuple(tokens[:4]), (7, 7), tuple(tokens[:12])]
    disk.close()
