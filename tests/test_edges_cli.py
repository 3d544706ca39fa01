"""The CLI at its edges: every failure is one `error: <message>` line on stderr and exit 1
(2 for arguments refused before any work), the traceback only with --log-level debug.

Each case drives the real command (`pipeline.cli.main`, or `python -m pipeline` where a
pipe, a signal or a second process is part of the case) on a real tiny container.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers_server import own_copy
from packjob import PackJob

from actors.routing_trace import TraceModel, TracePool, TraceRecorder, save_trace
from pipeline.cli import main
from qpack import spec
from qpack.reader import Container

REPO = Path(__file__).resolve().parents[1]
ENGINE = ["--slots", "16", "--prefill-chunk", "2", "--max-tokens", "2"]


@pytest.fixture(scope="module")
def tiny(synth_checkpoint, packed, tmp_path_factory) -> Path:
    return own_copy(packed(synth_checkpoint("qwen3_next"), bits=None), tmp_path_factory, "edges-cli")


@pytest.fixture
def copy(tiny, tmp_path) -> Path:
    out = tmp_path / "copy.qpack"
    shutil.copytree(tiny, out)
    return out


def one_error(err: str) -> str:
    """The stderr of a failed command: exactly one `error:` line and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "ExceptionGroup" not in err, err[-3000:]
    return lines[0]


def test_a_corrupt_expert_is_one_line_not_an_exception_group(copy, capsys):
    entry = Container.open(copy, verify="off").manifest.layers[1]
    path = copy / entry.file
    data = bytearray(path.read_bytes())
    for e in range(entry.num_experts):  # every expert of the layer: any route hits one
        data[e * entry.stride + 17] ^= 0x10
    path.write_bytes(bytes(data))
    config = copy.parent / "c.toml"
    config.write_text(f'[model]\npath = "{copy}"\n[run]\nprompts = ["Hello"]\nmax_tokens = 2\n')
    # generate, chat and run end with the same line: the damage and the fix, not the crc.
    want = re.compile(r"error: expert \d+ of layer 1 failed its checksum: the container is "
                      rf"damaged; run moestream verify {re.escape(str(copy))}$")
    for command in (["generate", str(copy), "--prompt", "Hello", *ENGINE],
                    ["chat", str(copy), "Hello", *ENGINE],
                    ["run", str(config), "--slots", "16", "--prefill-chunk", "2"]):
        assert main(command) == 1
        line = one_error(capsys.readouterr().err)
        assert want.match(line), line

    # --log-level debug shows where it came from, then the same line.
    assert main(["--log-level", "debug", "generate", str(copy), "--prompt", "Hello", *ENGINE]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error:") and "crc32" in err


def test_a_truncated_expert_file_is_one_line(copy, capsys):
    layer = copy / "experts" / "layer_002.bin"
    os.truncate(layer, layer.stat().st_size // 2)
    for command in (["generate", str(copy), "--prompt", "Hi", *ENGINE], ["chat", str(copy), "hi", *ENGINE]):
        assert main(command) == 1
        line = one_error(capsys.readouterr().err)
        assert "layer_002.bin" in line and "truncated or replaced" in line, line


def test_pool_refusals_name_the_numbers(tiny, capsys, tmp_path):
    info_json = main(["info", str(tiny), "--json", "--prefill-chunk", "2"])
    info = json.loads(capsys.readouterr().out)
    assert info_json == 0
    need = info["smallest_workable_slots"]
    # The minimum `info` reports is the one the engine enforces.
    assert main(["generate", str(tiny), "--slots", str(need - 1), "--prefill-chunk", "2"]) == 1
    line = one_error(capsys.readouterr().err)
    assert f"smallest workable pool is {need} slots" in line, line
    assert main(["generate", str(tiny), "--slots", str(need), "--prefill-chunk", "2", "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "moestream generate" in err and "moestream run" not in err  # the stats table's title

    assert main(["generate", str(tiny), "--pool-mb", "64", "--slots", "16"]) == 2
    assert "--pool-mb and --slots are exclusive" in capsys.readouterr().err
    # A timeline of a case the bench does not run: refused before any case runs.
    trace = tmp_path / "t.json"
    assert main(["bench", str(tiny), "--cases", "default", "--trace", str(trace),
                 "--trace-case", "long-prompt"]) == 2
    line = one_error(capsys.readouterr().err)
    assert "--trace-case 'long-prompt' is not among --cases default" in line, line
    assert not trace.exists()
    # An unknown case names the speculative ones too (they are patterns, not a list).
    assert main(["bench", str(tiny), "--cases", "default,spec-k2-0.8"]) == 2
    line = one_error(capsys.readouterr().err)
    assert "['spec-k2-0.8']" in line and "spec-k{1-8}-a{A}" in line, line


def test_the_default_budget_is_said_at_load_and_off_or_a_pool_size_leaves_it(tiny, capsys):
    args = ["--prompt", "Hi", "--max-tokens", "1", "--prefill-chunk", "2"]
    assert main(["generate", str(tiny), *args]) == 0
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "within a memory budget of" in err and "the default: --memory-mb or --pool-mb" in err, err
    for flags in (["--memory-mb", "off"], ["--slots", "16"]):
        assert main(["generate", str(tiny), *args, *flags]) == 0
        assert "memory budget" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's usage line and exit status
        main(["generate", str(tiny), *args, "--memory-mb", "lots"])
    assert exited.value.code == 2
    assert "expected MiB, auto or off, not 'lots'" in capsys.readouterr().err


def test_info_reports_the_minimum_the_default_prefill_chunk_needs(tiny, capsys):
    assert main(["info", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "prefill chunks follow the pool" in out and "decode only" in out
    assert "pool advice (reuse)" in out and "hits with next-gate" in out
    assert main(["info", str(tiny), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["prefill_chunk"] == 0  # the default: chunks follow the pool
    rows = info["pool_advice"]["rows"]
    assert rows and all(r["slots_per_layer"] >= info["top_k"] for r in rows)
    assert info["pool_advice"]["borrowed_for"] is None  # Qwen3-Next's routers have published statistics
    assert rows[-1]["pool_mb"] * 2**20 >= rows[-1]["slots_per_layer"] * info["moe_layers"] * info["expert_nbytes"]
    assert main(["info", str(tiny), "--json", "--no-advice"]) == 0
    assert "pool_advice" not in json.loads(capsys.readouterr().out)
    assert info["smallest_workable_slots"] == min(info["num_experts"], info["top_k"])
    assert main(["info", str(tiny), "--json", "--prefill-chunk", "256"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["smallest_workable_slots"] == min(info["num_experts"], 256 * info["top_k"])
    assert info["smallest_workable_pool_mb"] * 2**20 >= info["smallest_pool_bytes"]


def _inflate_experts(root: Path, expert_bytes: int) -> None:
    """Make every expert about `expert_bytes` long in the manifest (down_proj given that many
    more output rows, weight, scales and biases alike, so the format stays consistent), the
    layer files sparse to match: a container whose pool cannot fit in this machine's
    memory, at no disk cost."""
    path = root / spec.MANIFEST
    data = json.loads(path.read_text())
    for layer in data["layers"]:
        fmt = layer["format"]
        tensors = sorted(fmt["tensors"], key=lambda t: t["offset"])
        down = [x for x in tensors if x["name"].startswith("down_proj.")]
        row_bytes = sum(x["nbytes"] // x["shape"][0] for x in down)
        factor = max(1, expert_bytes // row_bytes // down[0]["shape"][0])
        offset = 0
        for x in tensors:
            if x["name"].startswith("down_proj."):
                x["shape"][0] *= factor
                x["nbytes"] *= factor
            x["offset"] = offset
            offset += x["nbytes"]
        fmt["nbytes"] = offset
        layer["stride"] = -(-fmt["nbytes"] // data["alignment"]) * data["alignment"]
        size = layer["stride"] * layer["num_experts"]
        os.truncate(root / layer["file"], size)
        next(f for f in data["files"] if f["path"] == layer["file"])["size"] = size
    path.write_text(json.dumps(data))


def test_an_explicit_pool_larger_than_memory_is_refused_with_the_numbers(copy, capsys):
    available = psutil.virtual_memory().available
    _inflate_experts(copy, available // 8)  # 16 slots = twice the available memory
    assert main(["generate", str(copy), "--slots", "16", "--prefill-chunk", "1"]) == 1
    line = one_error(capsys.readouterr().err)
    # Refused at open, nothing allocated or read: the numbers are the check's, not MLX's.
    assert "does not fit" in line and "of available memory" in line and "MiB" in line, line


def test_serve_on_a_busy_port_fails_before_loading_the_model(tiny, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # At info, so that a model load would show (engine.open): no clock needed to tell.
        assert main(["--log-level", "info", "serve", str(tiny), "--port", str(port),
                     "--slots", "16"]) == 1
    err = capsys.readouterr().err
    line = one_error(err)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "another --port" in line, line
    assert "engine.open" not in err and "loaded" not in err, err  # before the model loads


def test_run_without_a_source_is_one_line(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{tmp_path}/m.qpack"\n')
    assert main(["run", str(config)]) == 2
    line = one_error(capsys.readouterr().err)
    assert "model.source is not set" in line or "does not exist" in line, line


def test_run_with_a_source_that_does_not_exist_is_one_line(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{tmp_path}/m.qpack"\nsource = "{tmp_path}/no-such-checkpoint"\n')
    assert main(["run", str(config)]) in (1, 2)
    line = one_error(capsys.readouterr().err)
    assert "no-such-checkpoint" in line and "neither a checkpoint directory nor a hub repo id" in line


def test_run_takes_the_engine_flags(tiny, tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{tiny}"\n[run]\nprompts = ["Hi"]\nmax_tokens = 2\n')
    assert main(["run", str(config), "--slots", "3", "--prefill-chunk", "2"]) == 1
    assert "smallest workable pool" in one_error(capsys.readouterr().err)  # --slots reached the engine
    assert main(["run", str(config), "--slots", "16", "--prefill-chunk", "2", "--temperature", "0",
                 "--set", "run.max_tokens=1"]) == 0


def test_replay_with_too_few_slots_is_one_line(tmp_path, capsys):
    model = TraceModel(num_layers=2, moe_layers=[0, 1], num_experts=16, top_k=8, stride=16384)
    rec = TraceRecorder(model, TracePool(num_slots=16, policy="lru"))
    rec.begin_sequence()
    rec.begin_token("prefill")
    for layer in (0, 1):
        rec.record(layer, list(range(8)))
    path = tmp_path / "trace.json"
    save_trace(rec.trace, path)
    assert main(["replay", str(path), "--slots", "5", "--policies", "lru", "--strategies", "none"]) == 1
    assert "expert pool exhausted" in one_error(capsys.readouterr().err)


def test_a_closed_stdout_pipe_ends_quietly():
    """`moestream ... | head`: the reader is gone before the command writes."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "config", "config/demo.toml",
                             "--no-check-paths"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert err == "", err


def test_verify_problems_go_to_stderr(copy, capsys):
    layer = copy / "experts" / "layer_000.bin"
    data = bytearray(layer.read_bytes())
    data[100] ^= 1
    layer.write_bytes(bytes(data))
    assert main(["verify", str(copy)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "crc32" in captured.err and "error: 2 problem(s)" in captured.err


def test_synth_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["synth", "--family", "qwen3_next", "--preset", "tiny", "-o", str(out)]) == 2
    assert "exists and is not empty" in one_error(capsys.readouterr().err)
    assert (out / "config.json").read_text() == "{}"


def test_two_packs_into_one_directory(synth_checkpoint, fork_server, tmp_path, capsys):
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    out = tmp_path / "x.qpack"
    first = PackJob(fork_server, src, out, bits=None, stop_at="begin experts/layer_000.bin")
    try:
        first.wait_paused()  # holding the directory, mid-pack
        assert main(["pack", str(src), "-o", str(out), "--no-progress"]) == 2
        line = one_error(capsys.readouterr().err)
        assert "another pack is writing this directory" in line, line
    finally:
        first.kill(signal.SIGKILL)
    assert main(["pack", str(src), "-o", str(out), "--no-progress"]) == 0  # the lock died with it
    assert Container.open(out).manifest.num_experts > 0


def test_library_logs_go_to_stderr(tiny):
    """A program that imports the packages and never configures logging: stdout stays clean."""
    source = Container.open(tiny).manifest.source  # the same pack again: already complete
    code = f"import qpack\nqpack.pack({source!r}, {str(tiny)!r}, progress=False)\nprint('text')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "text\n"
    assert "pack.already_complete" in proc.stderr


def test_make_bench_runs_real_flags():
    """Every `moestream` line of the Makefile parses (`make bench` once passed a flag bench lacks)."""
    import shlex

    from pipeline.cli import build_parser

    lines = [line.split("$(BIN)/moestream", 1)[1] for line in (REPO / "Makefile").read_text().splitlines()
             if "$(BIN)/moestream" in line]
    assert any(line.split()[0] == "bench" for line in lines)
    for line in lines:
        build_parser().parse_args(shlex.split(line))


def test_verify_reports_progress_up_to_the_whole_container(tiny):
    from qpack.reader import verify_container

    seen: list[tuple[int, int]] = []
    assert verify_container(tiny, progress=lambda done, total: seen.append((done, total))).ok
    m = Container.open(tiny).manifest
    # Every file's sha256, then every expert's crc32: the MTP head's blobs too.
    total = sum(f.size for f in m.files) + sum(e.stride * e.num_experts for e in m.expert_entries)
    assert len(seen) > 4 and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


def test_chat_takes_turns_after_its_options(tiny, capsys):
    """`chat C --max-tokens 2 hi "and then?"`: turns may follow the options (argparse alone
    takes a positional list only before them); anything else unknown is still refused."""
    assert main(["chat", str(tiny), *ENGINE, "--max-tokens", "2", "hi", "and then?"]) == 0
    out = capsys.readouterr().out
    assert ">>> hi\n" in out and ">>> and then?\n" in out, out  # two turns, in order
    with pytest.raises(SystemExit):
        main(["chat", str(tiny), *ENGINE, "hi", "--bogus"])
    err = capsys.readouterr().err
    assert "unrecognized arguments:" in err and "--bogus" in err, err


def test_generate_takes_prompts_as_arguments_before_or_after_its_options(tiny, tmp_path, capsys):
    """`generate C "hi there" --max-tokens 2 "and two"` as llama.cpp's and mlx-lm's users
    type it (it was refused: "unrecognized arguments"); --prompt ones first."""
    stats = tmp_path / "stats.json"
    assert main(["generate", str(tiny), "hi there", *ENGINE, "and two", "--prompt", "first",
                 "--stats", str(stats)]) == 0
    runs = json.loads(stats.read_text())["runs"]
    assert [r["prompt"] for r in runs] == ["first", "hi there", "and two"], runs
    with pytest.raises(SystemExit):
        main(["generate", str(tiny), "hi", "--bogus"])
    assert "--bogus" in capsys.readouterr().err


def test_generate_reads_a_prompt_from_standard_input(tiny, tmp_path, capsys, monkeypatch):
    """`cat prompt.txt | moestream generate C -` (mlx-lm's `--prompt -`); input that is not
    UTF-8 text, or none, is one line naming it, before the model loads."""
    import io
    import sys

    stats = tmp_path / "stats.json"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Bonjour à tous\n".encode())))
    assert main(["generate", str(tiny), "-", "hi", *ENGINE, "--stats", str(stats)]) == 0
    assert [r["prompt"] for r in json.loads(stats.read_text())["runs"]] == ["Bonjour à tous\n", "hi"]
    for data, words in ((b"\xff\xfe", "standard input is not UTF-8 text"), (b" \n", "standard input is empty")):
        capsys.readouterr()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        assert main(["generate", str(tiny), "--prompt", "-"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: prompt '-': ") and words in err and err.count("\n") == 1, err


def test_generate_sends_prompts_through_the_chat_template_on_request(tiny, tmp_path):
    """Plain text by default (a completion); `--chat` a user turn through the model's
    template, `--system` a system message before it (as mlx-lm's --system-prompt)."""
    counts = {}
    for name, flags in (("raw", []), ("chat", ["--chat"]), ("system", ["--system", "Be brief."])):
        stats = tmp_path / f"{name}.json"
        assert main(["generate", str(tiny), "hi", *ENGINE, "--stats", str(stats), *flags]) == 0
        (run,) = json.loads(stats.read_text())["runs"]
        assert run["prompt"] == "hi"
        counts[name] = run["prompt_tokens"]
    assert counts["raw"] < counts["chat"] < counts["system"], counts


def test_the_log_flags_work_after_the_subcommand_too(tiny, capsys):
    """`moestream info C --log-level debug`, as a user adds a flag at the end of a command."""
    assert main(["info", str(tiny), "--log-level", "debug", "--log-json"]) == 0
    assert "model type" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--log-level: unknown level 'bogus'"):  # still checked
        main(["info", str(tiny), "--log-level", "bogus"])
