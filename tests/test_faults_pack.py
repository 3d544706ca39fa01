"""Packs killed at seeded random steps always resume to a byte-identical container.

tests/test_pack.py kills at chosen milestones; this file draws the milestones (any of the
~160 a tiny pack passes: each journal write before and after its rename, each `.partial`
begun, each expert or dense tensor written, each rename) and the signal (SIGKILL, SIGTERM
or SIGINT) from a seeded generator, five kills per pack, and checks after every kill that
the half-written directory is never taken for a container and that the journal only lists
whole files. Packs run in the shared fork server and stop exactly at the milestone drawn
(tests/packjob.py), so every seed kills at the same steps on every machine.
(Disk full, a real ENOSPC on a tmpfs, is covered in
tests/test_pack.py::test_full_disk_stops_naming_the_file_and_resumes_when_space_is_back.)
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
from packjob import PackJob, check_half_written, files

from qpack import spec
from qpack.reader import Container
from qpack.spec import JOURNAL, QpackError
from qpack.writer import pack

SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
EXIT_CODES = {signal.SIGKILL: -9, signal.SIGTERM: -15, signal.SIGINT: 128 + signal.SIGINT}


@pytest.fixture(scope="module")
def source(synth_checkpoint) -> Path:
    return synth_checkpoint("qwen3_next", dtype="bfloat16")


@pytest.fixture(scope="module")
def reference(source, packed) -> Path:
    return packed(source, bits=4)


@pytest.fixture(scope="module")
def milestones(source, fork_server, tmp_path_factory) -> list[str]:
    """Every milestone an uninterrupted pack passes, in order."""
    job = PackJob(fork_server, source, tmp_path_factory.mktemp("trace") / "x.qpack")
    assert job.join() == 0
    assert job.passed[:2] == ["journal-tmp start", "journal start"]
    assert job.passed[-1] == f"renamed {spec.MANIFEST}"
    return job.passed


def _kill_at(ctx, source: Path, out: Path, milestone: str, sig: signal.Signals) -> str:  # noqa: ANN001
    job = PackJob(ctx, source, out, stop_at=milestone)
    job.wait_paused()
    assert job.kill(sig) == EXIT_CODES[sig]
    if milestone == f"renamed {spec.MANIFEST}":  # only the journal's removal is left
        Container.open(out, verify="full").close()
        return "finished"
    check_half_written(out)
    return sig.name


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_pack_killed_at_random_moments_resumes_byte_identical(fork_server, source, reference,
                                                               milestones, tmp_path, seed):
    rng = random.Random(seed)
    out = tmp_path / "killed.qpack"
    # Later kills land later: each resumed pack passes every milestone after its last commit.
    for index in sorted(rng.sample(range(len(milestones)), 5)):
        _kill_at(fork_server, source, out, milestones[index], rng.choice(SIGNALS))
    pack(source, out, bits=4, progress=False)
    assert not (out / JOURNAL).exists()
    assert files(out) == files(reference)
    Container.open(out, verify="full").close()


def test_unreadable_journal_restarts_the_pack_byte_identical(fork_server, source, reference,
                                                             tmp_path):
    out = tmp_path / "journal.qpack"
    _kill_at(fork_server, source, out, "wrote experts/layer_001.bin 5", signal.SIGKILL)
    (out / JOURNAL).write_bytes(b'{"options": {"source": ')  # torn by a dying disk
    pack(source, out, bits=4, progress=False)
    assert files(out) == files(reference)


def test_missing_journal_in_a_half_written_directory_is_refused(fork_server, source, tmp_path):
    """Without its journal a directory of pack leftovers is not silently mixed into a pack."""
    out = tmp_path / "nojournal.qpack"
    _kill_at(fork_server, source, out, "wrote experts/layer_001.bin 5", signal.SIGTERM)
    (out / JOURNAL).unlink()
    with pytest.raises(QpackError, match="exists, is not empty and is not a partial container"):
        pack(source, out, bits=4, progress=False)
    with pytest.raises(QpackError, match="incomplete container"):
        Container.open(out)
