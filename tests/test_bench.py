"""The benchmark pieces: the fast bench container, `bench` end to end on a tiny model,
the timeline file format, and O_DIRECT reads."""

from __future__ import annotations

import json
import statistics
import sys
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from actors import timeline
from qpack.reader import Container, aligned_empty, verify_container

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_bench_container_is_valid_and_realistic(tiny_bench: Path) -> None:
    report = verify_container(tiny_bench)
    assert report.ok, report.problems
    with Container.open(tiny_bench, verify="first-use") as c:
        m = c.manifest
        entry = c.layer(0)
        assert len(set(entry.checksums)) == entry.num_experts  # no two experts alike
        buf = aligned_empty(entry.stride)
        c.read_expert(0, 5, buf)
        assert zlib.crc32(buf[: entry.format.nbytes]) == entry.checksums[5]
        views = c.expert_views(buf, 0)
        w = mx.dequantize(mx.array(views["gate_proj.weight"]),
                          mx.array(views["gate_proj.scales"]).view(mx.bfloat16),
                          mx.array(views["gate_proj.biases"]).view(mx.bfloat16),
                          group_size=m.quantization.group_size, bits=4)
        values = np.array(w.astype(mx.float32))
        fan_in = values.shape[1]
        assert abs(values.mean()) < 0.2 / np.sqrt(fan_in)
        assert 0.7 < values.std() * np.sqrt(fan_in) < 1.4


def test_bench_end_to_end_writes_json_and_trace(tiny_bench: Path, tmp_path: Path) -> None:
    import moestream_bench

    out, trace = tmp_path / "bench.json", tmp_path / "trace.json"
    # Each engine case is a fresh process of its own (seconds each): one runs here; what
    # "serial" changes is checked on the plan, and its ratio below.
    code = moestream_bench.main([
        "bench", str(tiny_bench), "--cases", "default,warm-all,io", "--slots", "8",
        "--prefill-chunk", "2", "--prompt-tokens", "6", "--max-tokens", "4",
        "--json", str(out), "--trace", str(trace), "--o-direct",
    ])
    assert code == 0
    report = json.loads(out.read_text())
    by_name = {r["name"]: r for r in report["results"]}
    assert set(by_name) == {"default", "warm-all", "io"}
    # The streamed forward is exact: every expert pooled decodes the default's tokens.
    assert report["derived"]["tokens_as_default"] == {"warm-all": True}
    # Against resident mlx-lm: alternate runs in one process, the median of the pairs.
    warm = by_name["warm-all"]
    engine, resident = warm["paired_engine_tok_s"], warm["paired_resident_tok_s"]
    assert len(engine) == len(resident) == 5 and min(engine + resident) > 0
    ratios = sorted(e / r for e, r in zip(engine, resident, strict=True))
    assert report["derived"]["warm_all_over_resident"] == ratios[2]
    assert report["derived"]["warm_all_best_over_resident"] == max(engine) / max(resident)
    assert warm["resident_decode_tok_s"] == sorted(resident)[2]
    assert all(r["error"] is None for r in by_name.values())
    default = by_name["default"]
    assert default["completion_tokens"] == 4 and default["decode_tok_s"] > 0
    assert default["strategy"] == "next-gate" and default["overlap"]
    # readers = auto: the depth the probe chose, from what it measured.
    assert default["readers"] >= 2 and default["queue_depth_gb_s"]
    # ... and a prompt's: up to the depth of the best bandwidth it measured (at most 8).
    best = max(default["queue_depth_gb_s"].items(), key=lambda kv: kv[1])[0]
    assert default["readers_prefill"] == max(default["readers"], min(int(best), 8))
    # Where decode's read time went: fractions are fractions, the split adds up.
    path = default["read_path"]
    assert 0 <= path["disk_busy_fraction"] <= 1 and path["mean_in_flight"] >= 0
    assert path["decode_s"] > 0 and path["pread_ms"] >= 0
    assert path["stall_late_s"] + path["stall_unpredicted_s"] <= path["decode_s"] + 1e-6
    # Compute's time in MLX calls is reported beside the stall (its other wait).
    assert path["mlx_s"] > 0 and path["shelved_mb"] >= 0
    assert by_name["io"]["read_gb_s"] > 0 and report["derived"]["io_ceiling_tok_s"] > 0
    # The disk's bandwidth: at each depth, the best taken (not the start-up probe's guess).
    io_depths = {int(d): v for d, v in by_name["io"]["queue_depth_gb_s"].items()}
    assert sorted(io_depths) == [1, 2, 4, 8, 16]
    assert by_name["io"]["read_gb_s"] == max(io_depths.values()) == io_depths[by_name["io"]["readers"]]
    # Memory while decoding is measured on its own: never above the process peaks, and
    # the CPU's MLX memory holds at least the pool.
    assert 0 < default["decode_rss_mb"] <= default["peak_rss_mb"] + 1
    assert default["pool_mb"] <= default["decode_device_mb"] <= default["peak_device_mb"]
    assert report["derived"]["memory_decode_mb"] == default["decode_rss_mb"]
    # The state copies beside the live state: the measured request's one checkpoint (its
    # prompt less the last token), not also the warm-up's states (forgotten after it).
    memory = default["memory"]
    assert 0 < memory["copies_mb"] <= memory["state_mb"], memory
    # The device's runtime is marked apart (a CUDA context's ~1 GB; next to nothing on the
    # CPU), and the host's growth is reported above it.
    assert 0 <= memory["runtime_mb"] < 64, memory
    assert report["derived"]["default_rss_over_runtime_mb"] == (
        default["peak_rss_mb"] - memory["process_mb"] - memory["runtime_mb"])
    assert 0 < default["open_s"] and 0 < default["warmup_s"]
    assert default["open_s"] + default["warmup_s"] < default["seconds"]
    assert default["os_threads"] > 1 if sys.platform.startswith("linux") else True
    if sys.platform.startswith("linux"):
        assert sum(default["rss_kinds"].values()) > 0 and default["rss_by_mapping"]

    data = timeline.load(trace)
    tracks = set(timeline.track_names(data).values())
    assert {"compute", "router", "sampler", "reader-0"} <= tracks
    names = {e["name"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert {"decode-step", "prefill-chunk", "sample", "stall"} <= names
    assert names & {"install", "land"}  # at the demand, or where reads land (reader.land)
    assert names & {"read", "prefetch"}


def test_a_warm_speculative_case_is_compared_with_plain_runs_of_its_own_engine(
        tiny_bench: Path, tmp_path: Path) -> None:
    """"x plain" of a warm-spec case is the median of (plain, speculative) pairs in its own
    engine (a request's speculative = "off"), the one run against warm-all's beside it."""
    import moestream_bench

    out = tmp_path / "spec.json"
    assert moestream_bench.main([
        "bench", str(tiny_bench), "--cases", "warm-spec-k2-a1.0", "--slots", "8",
        "--prefill-chunk", "2", "--prompt-tokens", "6", "--max-tokens", "6", "--json", str(out),
    ]) == 0
    report = json.loads(out.read_text())
    by_name = {r["name"]: r for r in report["results"]}
    spec, plain = by_name["warm-spec-k2-a1.0"], by_name["warm-all"]  # the reference, added
    runs, plains = spec["paired_spec_tok_s"], spec["paired_plain_tok_s"]
    assert len(runs) == len(plains) == 5 and min(runs + plains) > 0
    derived = report["derived"]
    ratios = sorted(s / p for s, p in zip(runs, plains, strict=True))
    assert derived["warm-spec-k2-a1.0_over_plain"] == ratios[2]
    assert derived["warm-spec-k2-a1.0_single_over_plain"] == spec["decode_tok_s"] / plain["decode_tok_s"]
    assert spec["verify_passes"] > 0 and spec["acceptance"] == 1.0
    assert not plain.get("paired_plain_tok_s")  # plain decode is not paired with itself
    # The split is of the measured run: the states its pairs (warm-all's with resident
    # mlx-lm) left in the prefix cache after it are not in it (they were: 5.3x the state).
    for memory in (spec["memory"], plain["memory"]):
        assert memory["copies_mb"] <= memory["state_mb"] * 1.5, memory


def test_rounds_interleave_the_cases_and_a_ratio_is_the_median_of_the_rounds(
        tiny_bench: Path, tmp_path: Path, capsys) -> None:
    """`--rounds 2`: the case list run twice, one round after the other; each
    round's speculating run drafts from and is compared with its own round's plain run."""
    import moestream_bench

    out = tmp_path / "rounds.json"
    assert moestream_bench.main([
        "bench", str(tiny_bench), "--cases", "spec-k2-a0.8", "--slots", "8", "--rounds", "2",
        "--prompt-tokens", "4", "--max-tokens", "4", "--json", str(out),
    ]) == 0
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    assert names == ["default", "spec-k2-a0.8", "default#2", "spec-k2-a0.8#2"]
    by_name = {r["name"]: r for r in report["results"]}
    derived = report["derived"]
    ratios = [by_name[f"spec-k2-a0.8{n}"]["decode_tok_s"] / by_name[f"default{n}"]["decode_tok_s"]
              for n in ("", "#2")]
    assert derived["spec-k2-a0.8_over_plain_rounds"] == ratios
    assert derived["spec-k2-a0.8_over_plain"] == statistics.median(ratios)
    assert derived["decode_tok_s_rounds"]["default"] == [
        by_name[f"default{n}"]["decode_tok_s"] for n in ("", "#2")]
    # Greedy speculation is exact in every round (the drafts are each round's reference's).
    plain = by_name["default"]["token_ids"]
    assert plain and all(by_name[f"spec-k2-a0.8{n}"]["token_ids"] == plain for n in ("", "#2"))
    assert derived["tokens_as_default"] == {"default#2": True}
    assert derived["tokens_as_reference"] == {"spec-k2-a0.8": True, "spec-k2-a0.8#2": True}
    assert all(by_name[f"spec-k2-a0.8{n}"]["verify_passes"] > 0 for n in ("", "#2"))
    table = capsys.readouterr().err
    assert "x plain by round" in table and f"{statistics.median(ratios):.2f}x" in table


def test_rounds_below_one_are_one_line(tiny_bench: Path, capsys) -> None:
    import moestream_bench

    with pytest.raises(SystemExit):
        moestream_bench.main(["bench", str(tiny_bench), "--rounds", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "--rounds" in err[-1] and "0" in err[-1] and "Traceback" not in "".join(err)


async def test_serial_reads_one_expert_at_a_time_and_prefetches_nothing(tiny_bench: Path) -> None:
    """The `serial` reference (the end-to-end run above measures `default` only): its plan
    turns overlap off, its engine then reads with one reader and predicts nothing, and
    `default_over_serial` is the ratio of their decode rates."""
    from pipeline.bench.spec import Result, engine_dict
    from pipeline.bench.summary import Report
    from pipeline.config.loading import config_from_dict
    from pipeline.engine import open_engine

    serial = next(c for c in _planned(tiny_bench, "serial") if c.name == "serial")
    assert serial.config["compute"]["overlap"] is False
    async with open_engine(config_from_dict(engine_dict(serial))) as engine:
        assert engine.facts.readers == 1
        assert engine.facts.strategy == "none"
    results = [Result(name="default", kind="moestream", decode_tok_s=6.0),
               Result(name="serial", kind="moestream", decode_tok_s=4.0)]
    assert Report({}, {"dense_mb": 1.0}, "", results).derived()["default_over_serial"] == 1.5


def test_tokens_are_compared_with_the_defaults_only_where_they_must_agree() -> None:
    from pipeline.bench.spec import Result
    from pipeline.bench.summary import Report

    def run(name: str, tokens: list[int], **kw: Any) -> Result:
        return Result(name=name, kind="moestream", token_ids=tokens,
                      **{"prompt_tokens": 16, "max_tokens": 4, **kw})

    results = [run("default", [1, 2, 3, 4]), run("serial", [1, 2, 3, 4]),
               run("warm-all", [1, 2, 9, 9]),
               run("long-prompt", [5, 6, 7, 8], prompt_tokens=1024),  # another prompt
               run("warm-spec-k2-a0.8", [1, 2, 8, 8], speculative="ngram"),  # drafts
               run("batch-2", [3, 3, 3, 3], concurrency=2),  # rows of their own
               run("default@calibrated", [4, 4, 4, 4], routing="calibrated")]
    derived = Report({}, {"dense_mb": 1.0}, "", results).derived()
    assert derived["tokens_as_default"] == {"serial": True, "warm-all": False}
    # A speculating case against its own plain reference, round by round: greedy
    # verification keeps plain decode's tokens whatever the drafts.
    assert derived["tokens_as_reference"] == {"warm-spec-k2-a0.8": False}
    from pipeline.bench.agreement import disagreement

    line = disagreement({"derived": derived})
    assert line is not None and "warm-all" in line and "serial" not in line
    rounds = [run("default", [1, 2, 3, 4]), run("spec-k2-a0.8", [1, 2, 3, 4], speculative="ngram"),
              run("default#2", [1, 2, 3, 5]), run("spec-k2-a0.8#2", [1, 2, 3, 5], speculative="ngram"),
              run("spec-k2-a0.8@calibrated", [4, 4], routing="calibrated", speculative="ngram")]
    derived = Report({}, {"dense_mb": 1.0}, "", rounds).derived()
    assert derived["tokens_as_reference"] == {"spec-k2-a0.8": True, "spec-k2-a0.8#2": True}
    assert derived["tokens_as_default"] == {"default#2": False}
    line = disagreement({"derived": derived})
    assert line is not None and "default#2" in line and "spec-k2" not in line
    assert disagreement({"derived": {"tokens_as_default": {"serial": True}}}) is None


def test_timeline_format_and_noop(tmp_path: Path) -> None:
    assert timeline.active() is None
    assert timeline.span("compute", "x") is timeline.span("router", "y")  # shared no-op
    path = tmp_path / "t.json"
    with timeline.recording(path) as tl:
        assert tl is not None and timeline.active() is tl
        with timeline.span("compute", "outer", layer=1), timeline.span("reader-2", "read"):
            pass
    assert timeline.active() is None
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["outer", "read"]
    assert all(e["dur"] >= 0 and e["pid"] == timeline.PID for e in events)
    outer = events[0]
    assert outer["args"] == {"layer": 1}
    tracks = timeline.track_names(data)
    assert tracks[outer["tid"]] == "compute" and tracks[events[1]["tid"]] == "reader-2"
    with pytest.raises(ValueError, match="traceEvents"):
        (tmp_path / "bad.json").write_text("{}")
        timeline.load(tmp_path / "bad.json")


def test_o_direct_reads_match_buffered(tiny_bench: Path) -> None:
    buf = aligned_empty(1 << 16)
    assert buf.ctypes.data % 4096 == 0
    with Container.open(tiny_bench, o_direct=True) as direct, Container.open(tiny_bench) as plain:
        stride = plain.layer(1).stride
        a, b = aligned_empty(stride), aligned_empty(stride)
        direct.read_expert(1, 7, a)  # falls back (with a warning) where O_DIRECT is refused
        plain.read_expert(1, 7, b)
        assert np.array_equal(a, b)


def _planned(model: Path, cases: str) -> list[Any]:
    """`moestream bench MODEL --cases CASES` on calibrated-gate then router routing, tiny
    settings: the cases it would run."""
    import argparse

    from pipeline.cli import bench as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    return bench_cli.plan_cases(parser.parse_args([
        "bench", str(model), "--cases", cases, "--routing", "calibrated-gate,router",
        "--slots", "8", "--prefill-chunk", "2", "--prompt-tokens", "6", "--max-tokens", "4",
    ]))


def test_bench_routing_cases_are_named_labelled_and_checked(tiny_bench: Path, capsys) -> None:
    import moestream_bench

    from pipeline.bench.cases import measure

    cases = _planned(tiny_bench, "default,serial")
    assert [(c.name, c.routing) for c in cases] == [
        ("default", "calibrated-gate"), ("serial", "calibrated-gate"),
        ("default@router", "router"), ("serial@router", "router")]
    assert all(c.config["reader"]["switch_interval_ms"] == 0.2 for c in cases)  # the default
    # One calibrated case in this process: the result says where its routing came from.
    result = measure(cases[0])
    assert result.error is None and result.completion_tokens == 4
    assert "benchmark only" in result.routing and "emulated gate" in result.routing
    assert result.eviction == "reuse" and 0.0 <= result.decode_hit_rate <= 1.0

    capsys.readouterr()
    assert moestream_bench.main(["bench", str(tiny_bench), "--routing", "calibrated,nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown routing ['nope']")
    # A flag out of its config key's range: one line before any case runs (each case's
    # process found it before, after the cases ahead of it had run).
    json_out = tiny_bench.parent / "never.json"
    assert moestream_bench.main(["bench", str(tiny_bench), "--cases", "io,warm-all", "--bank-slots",
                                 "-1", "--json", str(json_out)]) == 2
    err = capsys.readouterr().err
    assert err == ("error: <bench io>: pool.bank_slots: expected int in [0, 16_777_216], "
                   "got -1\n") and not json_out.exists()


def test_batch_cases_decode_rows_together_under_calibrated_routing(tiny_bench: Path) -> None:
    from pipeline.bench.batch import batch_derived
    from pipeline.bench.cases import measure
    from pipeline.bench.spec import Result

    cases = _planned(tiny_bench, "batch-1,batch-2")
    assert [(c.name, c.concurrency) for c in cases] == [
        ("batch-1", 1), ("batch-2", 2), ("batch-1@router", 1), ("batch-2@router", 2)]
    # Two rows, each routed as its own calibrated request, in one decode batch.
    two = measure(cases[1])
    assert two.error is None, two.error
    assert two.concurrency == 2 and two.completion_tokens == 8 and two.decode_tok_s > 0
    assert two.batch_rows_per_step > 1 and two.per_seq_ms_per_token > 0
    assert "benchmark only" in two.routing and two.eviction == "reuse"
    # Each batch-N is compared with batch-1 of its own routing.
    results = {name: Result(name=name, kind="moestream", decode_tok_s=tok_s, per_seq_ms_per_token=ms)
               for name, tok_s, ms in (("batch-1", 10.0, 100.0), ("batch-2", 15.0, 130.0),
                                       ("batch-1@router", 5.0, 200.0), ("batch-2@router", 20.0, 100.0))}
    derived = batch_derived(results)
    assert derived["batch_2_aggregate_over_1"] == 1.5
    assert derived["batch_2@router_aggregate_over_1"] == 4.0
    assert derived["batch_2@router_ms_per_token_over_1"] == 0.5


def test_a_failing_case_is_one_line_and_finished_cases_are_on_disk(tiny_bench: Path,
                                                                  tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import time

    from pipeline.bench.cases import run_case
    from pipeline.bench.spec import Case

    # A case whose worker raises: its error is the exception's one line, no traceback.
    missing = run_case(Case(name="default", model=str(tmp_path / "gone.qpack"), max_tokens=2))
    assert missing.error is not None and "\n" not in missing.error
    assert "gone.qpack" in missing.error and "Traceback" not in missing.error
    assert 'File "' not in missing.error
    # A failure inside the engine's nursery arrives wrapped in groups: the worker reports
    # the leaf (on the H200, a kv_bits case said only "Exceptions from Trio nursery").
    from pipeline.failures import one_line

    wrapped = ExceptionGroup("Exceptions from Trio nursery", [ExceptionGroup(
        "inner", [RuntimeError("[quantized_matmul] No implementation for problem shape")])])
    assert one_line(wrapped) == "RuntimeError: [quantized_matmul] No implementation for problem shape"

    # The JSON is rewritten after every case: a bench stopped (a time limit, a lost
    # machine) while its second case runs keeps its first.
    out = tmp_path / "partial.json"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, str(root / "benchmarks" / "moestream_bench.py"), "bench", str(tiny_bench),
         "--cases", "io,default", "--max-tokens", "4000", "--json", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the bench ended before its first case's JSON appeared"
        report = json.loads(out.read_text())
        assert [r["name"] for r in report["results"]] == ["io"]
        assert report["results"][0]["read_gb_s"] > 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_thread_cpu_names_the_busy_thread() -> None:
    """bench's per-thread CPU split (read_path.thread_cpu_s): a thread that spins is
    counted under its name without the number, one that sleeps is not."""
    import hashlib
    import threading
    import time

    from pipeline.bench import thread_cpu

    assert thread_cpu.group_of("moestream-read-3") == "moestream-read"
    assert thread_cpu.group_of("Trio thread 12") == "Trio thread"
    assert thread_cpu.group_of("MainThread") == "MainThread"

    # Both run until told to stop, so both are alive while sampled. The spinner burns its
    # CPU in sha256 (which releases the GIL): a spinner holding it made each of the
    # sampler's /proc reads wait out a switch interval, and the sample outlived the thread.
    stop = threading.Event()
    block = bytes(1 << 20)

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    busy = threading.Thread(target=spin, name="probe-spin-7")
    idle = threading.Thread(target=stop.wait, name="probe-idle-1")
    start = thread_cpu.sample()
    busy.start(), idle.start()
    try:
        time.sleep(0.5)
        later = thread_cpu.sample()
    finally:
        stop.set()
        busy.join(), idle.join()
    spent = thread_cpu.between(start, later)
    assert spent.get("probe-spin", 0) >= 0.1 and "probe-idle" not in spent, spent
