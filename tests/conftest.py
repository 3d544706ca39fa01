"""Shared fixtures, each made once per session: tiny synthetic checkpoints
(`synth_checkpoint`), containers packed from them (`packed`), and the fork server that
kill tests start packs from (`fork_server`)."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest

# The package is used from the checkout (not installed) when tests run as `.venv/bin/pytest`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The packer, the synthesizer and the fork server's modules (MLX, mlx-lm, transformers and
# torch behind them: seconds of CPU) are imported where they are used, not here: under
# xdist the controller process loads this file too, before it starts the workers, and
# never runs a test.


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where session-wide files go: under pytest-xdist every worker has its own basetemp
    below one directory of the run, so the workers make each checkpoint once between them."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(root: Path, key: str, build: Callable[[Path], Path]) -> Path:
    """`build(directory)` once per key across the workers (a file lock), its result path."""
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    done = root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            out = root / f"shared-{name}"
            out.mkdir(exist_ok=True)
            done.write_text(str(build(out)))
        return Path(done.read_text())


@pytest.fixture(scope="session")
def synth_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `synth_checkpoint(family: str, *, dtype="float32", bits=None, layout="hub") -> Path`.

    Returns the directory of the `tiny` preset of `family` ("qwen3_next" or "qwen3_5_moe"),
    seed 0, written once per argument combination per test session (shared by the xdist
    workers). `bits` 4 or 8 gives the
    MLX-quantized layout (what `mlx_lm.convert -q` writes); `layout="per-expert"` gives
    transformers' text-only Qwen3.5 MoE layout; `variant="thinking"` Qwen3-Next's Thinking
    template and generation_config; `preset` another small preset (deepseek_v3 "kimi-tiny":
    Kimi-K2's tokenizer and chat); `mode` (mxfp4, nvfp4, mxfp8) and `recipe` (mixed_3_6, ...)
    what mlx_lm.convert --q-mode / --quant-predicate write. Treat the directory as read-only.
    """
    made: dict[tuple[str, str, int | None, str, str | None, str, str | None, str], Path] = {}

    def make(family: str, *, dtype: str = "float32", bits: int | None = None,
             layout: str = "hub", variant: str | None = None, mode: str = "affine",
             recipe: str | None = None, preset: str = "tiny") -> Path:
        from qpack.synth.checkpoint import synthesize

        key = (family, dtype, bits, layout, variant, mode, recipe, preset)
        if key not in made:
            made[key] = _once(_shared_root(tmp_path_factory), f"synth {key!r}", lambda out: synthesize(
                out, family, preset, dtype=dtype, bits=bits, layout=layout, progress=False,
                variant=variant, mode=mode, recipe=recipe))
        return made[key]

    return make


@pytest.fixture
def info_logs() -> Iterator[None]:
    """structlog passing info events for the test: a CLI run in-process earlier in this
    worker may have left it filtering at warning, which drops them before any capture."""
    import logging

    import structlog

    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `packed(source, **pack_options) -> Path`, the container `tiny.qpack`
    packed from `source` once per option set per session. Read-only: a test that damages
    a container damages a copy."""
    made: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def make(source: Path, **options: Any) -> Path:
        key = (str(source), tuple(sorted(options.items())))
        if key not in made:
            def build(out: Path) -> Path:
                from qpack.writer import pack

                pack(source, out / "tiny.qpack", progress=False, **options)
                return out / "tiny.qpack"

            made[key] = _once(_shared_root(tmp_path_factory), f"packed {key!r}", build)
        return made[key]

    return make


_TMPFS = Path("/dev/shm")
# The full run's files peaked at 3.5 GiB under -n 2 (the kept fixtures plus the running
# tests' own); a 24 GiB machine's default /dev/shm is 12 GiB.
_TMPFS_FREE = 6 * 2**30


def _remove_orphans() -> None:
    """The directories of runs whose process is gone (killed before its cleanup ran): on a
    tmpfs they would hold their memory until a reboot."""
    for old in _TMPFS.glob("moestream-tests-*-*"):
        pid = old.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # alive (another user's run): not ours to remove


def _remove_run(base: str) -> None:
    """The run's files, all but multiprocessing's own temporary directory (`pymp-*`
    under TMPDIR), which its exit handler removes after this and raised FileNotFoundError
    at exit when it was gone; the empty directories left are the next run's orphans."""
    for path in Path(base).iterdir():
        if path.name == "tmp":
            for inner in path.iterdir():
                if not inner.name.startswith("pymp-"):
                    if inner.is_dir() and not inner.is_symlink():
                        shutil.rmtree(inner, ignore_errors=True)
                    else:
                        inner.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _tmpfs_basetemp(config: pytest.Config) -> None:
    """The run's temporary files on a tmpfs where there is one with room (and O_DIRECT,
    which the reader's direct path opens with): the suite writes some 7 GB of synthetic
    checkpoints and containers, and on the ext4 of the 2-core VM (discard) writing and
    unlinking them cost more kernel time than the tests' own work (tests/test_pack.py with
    tests/test_hostile_container.py: 27.5 s on disk, 15.5 s on /dev/shm). Only the process
    that starts the run chooses: the xdist workers get their basetemp below it, and TMPDIR
    (where unset) points beside it. A given --basetemp is kept."""
    if config.option.basetemp or hasattr(config, "workerinput") or not sys.platform.startswith("linux"):
        return
    try:
        _remove_orphans()
        vfs = os.statvfs(_TMPFS)
        if vfs.f_bavail * vfs.f_frsize < _TMPFS_FREE:
            return
        base = tempfile.mkdtemp(prefix=f"moestream-tests-{os.getpid()}-", dir=_TMPFS)
    except OSError:
        return
    try:
        probe = os.path.join(base, "probe")
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT))
        os.unlink(probe)
    except (OSError, AttributeError):
        shutil.rmtree(base, ignore_errors=True)
        return
    config.add_cleanup(lambda: _remove_run(base))
    config.option.basetemp = os.path.join(base, "pytest")
    if "TMPDIR" not in os.environ:
        # What the code itself puts in the temporary directory (a private copy of each
        # container's tokenizer files per process, 15 MB at Qwen3.5's vocabulary; the
        # launcher's hostfiles; the tokenizer cache below), in this process, the workers,
        # the fork server and every subprocess.
        os.mkdir(tmp := os.path.join(base, "tmp"))
        _keep_mlx_kernels(tmp)
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = None  # gettempdir() asks again


def _keep_mlx_kernels(tmp: str) -> None:
    """MLX's CPU backend compiles each fused kernel of `mx.compile` with the system C++
    compiler into `<temporary directory>/mlx/<version>/cpu` and reuses it from there in
    every later process. Left under this run's own TMPDIR, every run compiled them all
    again (some 30 kernels, 0.5-1 s of g++ each, ~20 s of CPU a run, the test that met one
    first waiting on it: tests/test_quant_modes.py's float_experts case 4.6 s against 0.8
    s warm). `<run>/tmp/mlx` points where MLX keeps them without the redirect (the
    temporary directory of the environment the run started in), so the cache lives across
    runs as it does for any user; a clean machine's first run still compiles them."""
    kernels = os.path.join(tempfile.gettempdir(), "mlx")
    try:
        os.makedirs(kernels, exist_ok=True)
        os.symlink(kernels, os.path.join(tmp, "mlx"))
    except OSError:
        pass  # not writable there: MLX compiles into the run's TMPDIR, as before


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads the option
def pytest_configure(config: pytest.Config) -> None:
    _tmpfs_basetemp(config)
    # The engine's tokenizer.json parsed once per content in this process (shared_tokenizers.py).
    import shared_tokenizers

    shared_tokenizers.install()
    # What the code caches between processes (built tokenizers) stays in a directory of
    # this run: set before the xdist workers, the fork server and any test's subprocess
    # start, so all of them share it; removed by the process that made it.
    if "MOESTREAM_CACHE" not in os.environ:
        os.environ["MOESTREAM_CACHE"] = made = tempfile.mkdtemp(prefix="moestream-cache-")
        config.add_cleanup(lambda: shutil.rmtree(made, ignore_errors=True))


def _start_fork_server() -> BaseContext:
    import forked_cli
    import forked_launch
    import forked_ranks
    import packjob

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(packjob.PRELOAD + forked_cli.PRELOAD + forked_ranks.PRELOAD
                              + forked_launch.PRELOAD)
    forkserver.ensure_running()  # returns at once; the server imports PRELOAD on its own
    return ctx


def pytest_collection_finish(session: pytest.Session) -> None:
    # Started now, the fork server imports the packer and the engine on the other core
    # while the tests before the first that needs it run.
    if any("fork_server" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_fork_server()
    # What collection imported (MLX, mlx-lm, transformers, torch, the clients: some 300k
    # objects that live as long as the process) leaves the collector's view, so each full
    # collection while tests run no longer walks all of it (about 40 % of that time in
    # tests/test_server_conformance.py). Nothing is kept alive that was not already.
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def fork_server() -> BaseContext:
    """The fork server for `packjob.PackJob` and `forked_cli.ForkedCLI`: packer, CLI and
    engine preloaded, so a forked pack or `moestream serve` starts at once."""
    return _start_fork_server()


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next container as `moestream bench-container` writes them (per module)."""
    from qpack.synth.bench_container import write_bench_container

    out = tmp_path_factory.mktemp("bench") / "tiny.qpack"
    write_bench_container(out, "qwen3_next", "tiny", seed=3)
    return out
