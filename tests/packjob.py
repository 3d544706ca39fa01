"""Packs run in a fork server that has already imported the packer, stopped at named steps.

`import qpack.writer` costs seconds (MLX, mlx-lm); a fork of a server that preloaded it
starts a pack in a fraction of one. The packer writes the name of every milestone it
passes to a pipe (`qpack.milestones.PAUSE_ENV`) and stops at the one asked for, so a test
sends its signal at an exact step of the pack: no polling of files, no race with a pack
that runs on. `pack_on_a_full_disk` runs `moestream pack` against a real ENOSPC, on a
tmpfs that only its forked child sees (tests/private_tmpfs.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
from multiprocessing import connection
from multiprocessing.context import BaseContext
from pathlib import Path

import msgspec
import pytest
import structlog

from qpack.milestones import PAUSE_ENV
from qpack.reader import Container, verify_container
from qpack.spec import JOURNAL, QpackError
from qpack.writer import Journal, pack

# What the fork server imports once; its children (which import this module to find
# `_child`) then find all of it loaded.
PRELOAD = ["qpack.writer", "qpack.hub", "qpack.source", "qpack.quantize", "packjob"]


def _quiet() -> None:
    """Warnings and errors only: the fork server's output is the terminal, not pytest's
    capture, and a pack's info lines would land in the middle of the test report."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _child(w: connection.Connection, source: str, out: str, bits: int | None,
           stop_at: str) -> None:
    # The fork server's children inherit *its* environment: the hook is set here.
    os.environ[PAUSE_ENV] = f"{w.fileno()}:{stop_at}"
    # SIGINT stands for a terminal's Ctrl-C, whatever the runner's disposition: a test run
    # started in the background by a script inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _quiet()
    try:
        pack(source, out, bits=bits, progress=False)
    except KeyboardInterrupt:  # what Ctrl-C does, less the traceback in the test log
        os._exit(128 + signal.SIGINT)


def _cli(argv: list[str]) -> tuple[int, str]:
    """`moestream ARGV` in this process: (exit code, stderr)."""
    import argparse
    import contextlib
    import io

    from pipeline.cli.pack import register

    parser = argparse.ArgumentParser(prog="moestream")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = args.func(args)
    return code, err.getvalue()


def _fill(mnt: str) -> None:
    """Write a file at `mnt` until the disk is full."""
    block = b"\0" * (1 << 16)
    with open(f"{mnt}/fill", "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass


def _full_disk_child(w: connection.Connection, source: str, mnt: str, result: str) -> None:
    import threading

    from private_tmpfs import enter_private_namespace, mount_tmpfs

    _quiet()
    try:
        enter_private_namespace()
        mount_tmpfs(Path(mnt), "256m")
    except OSError as exc:
        w.send(("no tmpfs", str(exc)))
        return
    # The pack starts with room (its free-space check passes), stops at its first expert
    # file, the disk is filled under it, and it goes on into a real ENOSPC.
    r_fd, w_fd = os.pipe()
    hook = f"{w_fd}:begin experts/layer_000.bin"
    os.environ[PAUSE_ENV] = hook

    def go_on(*_: object) -> None:
        os.environ[PAUSE_ENV] = f"{w_fd}:"

    signal.signal(signal.SIGUSR1, go_on)

    def filler() -> None:
        seen = b""
        while b"begin experts/layer_000.bin" not in seen:
            seen += os.read(r_fd, 1 << 16)
        _fill(mnt)
        os.kill(os.getpid(), signal.SIGUSR1)
        while os.read(r_fd, 1 << 16):  # drain: the pack must never block on the pipe
            pass

    threading.Thread(target=filler, daemon=True).start()
    argv = ["pack", source, "-o", f"{mnt}/x.qpack", "--bits", "4", "--no-progress"]
    first = _cli(argv)
    del os.environ[PAUSE_ENV]
    journal_tmp_left = Path(f"{mnt}/x.qpack/{JOURNAL}.tmp").exists()
    os.unlink(f"{mnt}/fill")
    second = _cli(argv)
    first = (*first, journal_tmp_left)
    shutil.copytree(f"{mnt}/x.qpack", result)
    w.send((first, second))


def pack_on_a_full_disk(ctx: BaseContext, source: Path, tmp: Path) -> tuple[Path, tuple, tuple]:
    """`moestream pack` onto a private tmpfs that fills up mid-pack, then again once the
    filler is gone: (the container copied out, (exit, stderr, journal .tmp left) of the
    first run, (exit, stderr) of the second). Skips where no private tmpfs can be mounted."""
    mnt, result = tmp / "mnt", tmp / "result.qpack"
    mnt.mkdir()
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_full_disk_child, args=(w, str(source), str(mnt), str(result)))
    proc.start()
    w.close()
    if not connection.wait([r], 300):
        proc.kill()
        raise AssertionError("pack on a full disk: no answer in 300 s")
    try:
        outcome = r.recv()
    except EOFError:
        outcome = None
    proc.join(30)
    assert outcome is not None, f"full-disk child died (exit {proc.exitcode})"
    if outcome[0] == "no tmpfs":
        pytest.skip(f"cannot mount a private tmpfs here: {outcome[1]}")
    return result, outcome[0], outcome[1]


class PackJob:
    """`pack(source, out, bits=bits)` in a forked child; `stop_at` names the milestone
    ("journal start", "wrote experts/layer_001.bin 7", ...) where it stops, None for none."""

    def __init__(self, ctx: BaseContext, source: Path, out: Path, *, bits: int | None = 4,
                 stop_at: str | None = None) -> None:
        self.stop_at = stop_at
        self.passed: list[str] = []  # milestones, in the order the pack reached them
        self._pending = b""
        self._r, w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child, args=(w, str(source), str(out), bits, stop_at or ""))
        self.proc.start()
        w.close()  # the child holds the only write end: EOF when it is gone

    def _read(self, timeout: float) -> bool:
        """Read what the pipe holds; False at EOF (the child is gone)."""
        if not connection.wait([self._r], timeout):
            raise AssertionError(f"pack silent for {timeout} s after {self.passed[-3:]}")
        data = os.read(self._r.fileno(), 1 << 16)
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        self.passed += [line.decode() for line in lines]
        return bool(data)

    def wait_paused(self, timeout: float = 120) -> None:
        """Until the pack stands still at `stop_at`; fails if it ends before."""
        assert self.stop_at is not None
        while not self.passed or self.passed[-1] != self.stop_at:
            if not self._read(timeout):
                self.proc.join(30)
                raise AssertionError(f"pack ended (exit {self.proc.exitcode}) before "
                                     f"{self.stop_at!r}; passed {self.passed[-5:]}")

    def kill(self, sig: signal.Signals) -> int:
        """Send `sig` to the paused pack; its exit code once it is gone."""
        os.kill(self.proc.pid, sig)
        return self.join()

    def join(self, timeout: float = 120) -> int:
        while self._read(timeout):
            pass
        self.proc.join(timeout)
        assert self.proc.exitcode is not None, "pack did not end"
        self._r.close()
        return self.proc.exitcode


def check_half_written(out: Path) -> None:
    """What a kill leaves: never taken for a container; a journal that lists only whole
    files (size and sha256); at most one `.partial`."""
    with pytest.raises(QpackError, match=r"incomplete container \(no manifest.json\); re-run pack to resume"):
        Container.open(out)
    assert not verify_container(out).ok
    partials = list(out.rglob("*.partial"))
    assert len(partials) <= 1, partials
    if not (out / JOURNAL).exists():  # killed before its first journal was in place
        assert [p.name for p in out.iterdir()] == [JOURNAL + ".tmp"]
        return
    journal = msgspec.json.decode((out / JOURNAL).read_bytes(), type=Journal)
    for rel, done in journal.done.items():
        data = (out / rel).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (done.size, done.sha256), rel


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path: what byte-identical compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
