"""Commands that write big outputs check the free space first and refuse with the numbers.

The disk is a real 3 MiB tmpfs in a private mount namespace (unshare); each command runs
for real against it and must stop before writing anything that would not fit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qpack import spec
from qpack.synth.presets import get_preset
from qpack.writer import pack

REPO = Path(__file__).resolve().parents[1]


def test_synth_pack_bench_container_and_run_refuse_when_the_disk_is_too_small(synth_checkpoint, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs")
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    reference = tmp_path / "ref.qpack"
    pack(src, reference, bits=4, progress=False)
    packed = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "run.toml").write_text(f'[model]\npath = "{mnt}/demo.qpack"\nsource = "synth:demo"\n')
    # One interpreter runs the four commands through the real CLI entry point (each an
    # interpreter of its own would spend most of the test importing MLX).
    commands = {
        "pack": ["pack", str(src), "-o", f"{mnt}/x.qpack", "--bits", "4", "--no-progress"],
        "synth": ["synth", "--family", "qwen3_next", "--preset", "demo", "-o", f"{mnt}/s", "--no-progress"],
        "bench": ["bench-container", "--family", "qwen3_next", "--preset", "demo", "-o", f"{mnt}/b.qpack"],
        "run": ["run", f"{tmp_path}/run.toml"],
    }
    code = ("import sys\nfrom pipeline.cli import main\n"
            f"for name, argv in {commands!r}.items():\n"
            "    print(f'{name}={main(argv)}', file=sys.stderr, flush=True)\n")
    (tmp_path / "cmds.py").write_text(code)
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {mnt} || exit 77\n"
        f"{sys.executable} {tmp_path}/cmds.py\n"
        f"echo used=$(du -sk {mnt} | cut -f1) >&2\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 77 or "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr[-300:]}")
    err = proc.stderr
    assert "pack=2" in err and "synth=2" in err and "bench=2" in err, err[-3000:]
    assert re.search(r"run=[12]\b", err), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # The estimate is the real size: pack's number matches what a pack writes, within 5%
    # and the one alignment per MTP expert the estimate allows for (16 experts: at this
    # size, 8 % of the container).
    needed = re.search(r"x\.qpack: packing needs ([\d.]+) MiB, but only ([\d.]+) MiB is free", err)
    assert needed, err[-3000:]
    allowance = get_preset("qwen3_next", "tiny").num_experts * spec.ALIGNMENT
    assert abs(float(needed[1]) * 2**20 - packed) < 0.05 * packed + allowance, (needed[1], packed)
    assert float(needed[2]) <= 3.0
    assert re.search(r"synth demo needs 1\.\d\d GB, but only [\d.]+ MiB is free", err), err[-3000:]
    assert re.search(r"bench-container demo needs 0\.\d\d GB", err), err[-3000:]
    # `run` refuses before its first step, for both: synthesis (1.21 GB, the MTP head
    # included) and pack (0.38 GB).
    assert re.search(r"demo\.qpack: synth demo \+ pack needs 1\.5\d GB, but only", err), err[-3000:]
    used_kb = int(re.search(r"used=(\d+)", err)[1])
    assert used_kb < 64, f"{used_kb} KiB written before refusing"


def test_a_disk_filled_during_synth_is_one_line_and_leaves_no_shards(tmp_path):
    """Room at the check, then another process fills the disk while synth writes."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=160m tmpfs {mnt} || exit 77\n"
        # kimi-tiny keeps Kimi-K2's whole vocabulary: 87 MB to write, time for dd to fill the rest.
        f"{sys.executable} -m pipeline synth --family deepseek_v3 --preset kimi-tiny --dtype float32 "
        f"-o {mnt}/s --no-progress & pid=$!\n"
        f"while ! ls {mnt}/s/model* >/dev/null 2>&1; do sleep 0.005; done\n"
        f"dd if=/dev/zero of={mnt}/fill bs=64k 2>/dev/null\n"
        f"wait $pid; echo synth=$? >&2\n"
        f"ls {mnt}/s >&2\n"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode == 77 or "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr[-300:]}")
    err = proc.stderr
    if "synth=0" in err:
        pytest.skip("synth finished before the disk filled up")  # a very fast disk and CPU
    assert "synth=2" in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "disk full (ENOSPC) while writing the checkpoint" in lines[0], err[-3000:]
    assert "Traceback" not in err and "model-" not in err.split("synth=2", 1)[1], err[-3000:]
