"""Outputs: checked before the work, written whole or not at all, nothing written beside
or above them. `--record-routing /proc` once left `/proc.tmp` at the root, a stats path
in a missing directory made that directory, a failed synth left a `.partial` and a
failed bench-container a half-written directory that the re-run refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from qpack.milestones import PAUSE_ENV
from qpack.synth.st_write import TensorEntry, write_safetensors

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, **run: str) -> Path:
    # A container that does not exist yet (synth:): refusing the outputs must come before
    # synthesizing or packing anything.
    lines = ["[model]", f'path = "{tmp_path}/m.qpack"', 'source = "synth:tiny"', "[run]"]
    lines += [f'{k} = "{v}"' for k, v in run.items()]
    path = tmp_path / "c.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("key, target, expected", [
    ("record_routing", "{d}", "run.record_routing is a directory, not a file"),
    ("stats", "{d}/missing/deeper/s.json", "run.stats: directory {d}/missing/deeper does not exist"),
    ("trace", "{d}/none/t.json", "run.trace: directory {d}/none does not exist"),
])
def test_run_refuses_unwritable_outputs_before_any_work(tmp_path, capsys, key, target, expected) -> None:
    d = tmp_path / "out"
    d.mkdir()
    config = _config(tmp_path, **{key: target.format(d=d)})
    assert main(["run", str(config)]) == 2
    assert expected.format(d=d) in _one_error(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "out"]  # nothing packed
    assert list(d.iterdir()) == []  # no directory made, no temporary beside the output


def test_outputs_beside_a_container_packed_on_this_first_run_are_written(tmp_path, capsys) -> None:
    """The demo's layout: stats under the container's directory, which the first run makes."""
    data = tmp_path / "data"
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{data}/m.qpack"\nsource = "synth:tiny"\n'
                      f'[run]\nprompts = ["Hi"]\nmax_tokens = 1\nstats = "{data}/s.json"\n')
    assert main(["run", str(config)]) == 0, capsys.readouterr().err
    assert (data / "s.json").is_file() and (data / "m.qpack" / "manifest.json").is_file()


def test_replay_refuses_its_json_output_before_replaying(tmp_path, capsys) -> None:
    out = tmp_path / "missing" / "r.json"
    assert main(["replay", "--workload", "qwen3-next-80b,requests=1,decode_tokens=4,layers=2",
                 "--json", str(out)]) == 2
    assert _one_error(capsys.readouterr().err) == f"error: {out}: --json: directory {out.parent} does not exist"
    assert not out.parent.exists()


def test_a_safetensors_write_that_fails_leaves_no_partial(tmp_path) -> None:
    def short() -> list[np.ndarray]:  # a producer that yields fewer bytes than declared
        return [np.zeros(3, np.float32)]

    entry = TensorEntry("w", "F32", (4,), short)
    with pytest.raises(ValueError, match="produced 12 bytes, expected 16"):
        write_safetensors(tmp_path / "model.safetensors", [entry])
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_synth_removes_its_output_so_a_rerun_starts_clean(tmp_path) -> None:
    out = tmp_path / "src"
    # The synth stops mid-shard (its .partial open, the header written) until a signal
    # comes: Ctrl-C lands there however loaded the machine, not after a finished synth.
    r, w = os.pipe()
    stop_at = "begin model-00002-of-00005.safetensors"
    env = {**os.environ, PAUSE_ENV: f"{w}:{stop_at}"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "synth", "--family", "qwen3_next",
                             "--preset", "tiny", "--shard-mb", "1", "-o", str(out)], cwd=REPO,
                            env=env, pass_fds=(w,),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # A job started in the background by a shell inherits SIGINT
                            # ignored (and Python then keeps it so): Ctrl-C must reach it.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(w)
    try:
        with os.fdopen(r) as steps:  # the synth's steps, up to the one it stops at
            seen = []
            while (step := steps.readline().strip()) != stop_at:
                assert step, f"the synth ended before {stop_at!r}: {seen}"
                seen.append(step)
        assert (out / "model-00002-of-00005.safetensors.partial").exists()
        proc.send_signal(signal.SIGINT)  # Ctrl-C mid-shard
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert not out.exists(), sorted(os.listdir(out))

