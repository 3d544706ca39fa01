"""Packs killed at random moments always resume to a byte-identical container.

tests/test_pack.py kills at chosen file-system milestones (journal, .partial, rename);
this file kills after seeded random delays, with SIGKILL, SIGTERM or SIGINT, several
times per pack, and checks after every kill that the half-written directory is never
taken for a container and that the journal only lists whole files. The packs run in
a fork server that has already imported the packer, so a kill costs ~0.2 s, not the
~7 s of a fresh interpreter. (Disk full, a real ENOSPC on a tmpfs, is covered in
tests/test_pack.py::test_full_disk_stops_naming_the_file_and_resumes_when_space_is_back.)
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import msgspec
import pytest

from qpack import spec
from qpack.reader import Container, verify_container
from qpack.spec import QpackError
from qpack.writer import JOURNAL, TEST_DELAY_ENV, Journal, pack

DELAY_S = "0.05"  # per expert and per file: a tiny pack takes ~6 s, so kills land inside
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)


@pytest.fixture(scope="module")
def ctx():  # noqa: ANN201
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["qpack.writer", "qpack.hub", "qpack.source", "qpack.quantize"])
    return ctx


@pytest.fixture(scope="module")
def source(synth_checkpoint) -> Path:
    return synth_checkpoint("qwen3_next", dtype="bfloat16")


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ref.qpack"
    pack(source, out, bits=4, progress=False)
    return out


def _start(ctx, source: Path, out: Path, delay: str = DELAY_S):  # noqa: ANN001, ANN202
    # The fork server's children inherit *its* environment, not ours: set the delay in the
    # child itself (exec of a snippet: a builtin pickles by name, no test module import).
    code = (f"import os; os.environ[{TEST_DELAY_ENV!r}] = {delay!r}\n"
            "from qpack.writer import pack\n"
            f"pack({str(source)!r}, {str(out)!r}, bits=4, progress=False)\n")
    proc = ctx.Process(target=exec, args=(code,))
    proc.start()
    return proc


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _check_half_written(out: Path) -> None:
    """What a kill leaves: never a container; a journal that lists only whole files."""
    with pytest.raises(QpackError, match=r"incomplete container \(no manifest.json\)"):
        Container.open(out)
    assert not verify_container(out).ok
    partials = list(out.rglob("*.partial"))
    assert len(partials) <= 1, partials
    journal = msgspec.json.decode((out / JOURNAL).read_bytes(), type=Journal)
    for rel, done in journal.done.items():
        data = (out / rel).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (done.size, done.sha256), rel


def _kill_once(ctx, source: Path, out: Path, rng: random.Random) -> str:  # noqa: ANN001
    proc = _start(ctx, source, out)
    deadline = time.monotonic() + 60
    while not (out / JOURNAL).exists() and proc.exitcode is None:
        assert time.monotonic() < deadline, "pack never started"
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 1.5))
    sig = rng.choice(SIGNALS)
    finished = proc.exitcode is not None
    if not finished:
        os.kill(proc.pid, sig)
    proc.join(30)
    assert proc.exitcode is not None, "pack did not die"
    if (out / spec.MANIFEST).exists():
        return "finished"
    _check_half_written(out)
    return sig.name


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_pack_killed_at_random_moments_resumes_byte_identical(ctx, source, reference, tmp_path,
                                                               seed):
    rng = random.Random(seed)
    out = tmp_path / "killed.qpack"
    outcomes = [_kill_once(ctx, source, out, rng) for _ in range(5)]
    assert outcomes.count("finished") <= 2, outcomes  # most kills land mid-pack
    proc = _start(ctx, source, out, "0")
    proc.join(120)
    assert proc.exitcode == 0
    assert not (out / JOURNAL).exists()
    assert _files(out) == _files(reference)
    Container.open(out, verify="full").close()


def test_unreadable_journal_restarts_the_pack_byte_identical(ctx, source, reference, tmp_path):
    out = tmp_path / "journal.qpack"
    _kill_once(ctx, source, out, random.Random(7))
    (out / JOURNAL).write_bytes(b'{"options": {"source": ')  # torn by a dying disk
    pack(source, out, bits=4, progress=False)
    assert _files(out) == _files(reference)


def test_missing_journal_in_a_half_written_directory_is_refused(ctx, source, tmp_path):
    """Without its journal a directory of pack leftovers is not silently mixed into a pack."""
    rng = random.Random(11)
    for attempt in range(5):
        out = tmp_path / f"nojournal-{attempt}.qpack"
        if _kill_once(ctx, source, out, rng) != "finished" and len(list(out.iterdir())) > 1:
            break
    (out / JOURNAL).unlink()
    with pytest.raises(QpackError, match="exists, is not empty and is not a partial container"):
        pack(source, out, bits=4, progress=False)
    with pytest.raises(QpackError, match="incomplete container"):
        Container.open(out)
