"""Pipeline-parallel ranks (pipeline/distributed): the split, the wire, and real jobs.

The jobs are real processes on localhost joined by mlx.distributed's ring backend, as
`mlx.launch -n N --backend ring` starts them (tests/forked_ranks.py): three ranks must
give the logits and greedy tokens of one process for both families; two ranks serve the
OpenAI API, and when one is killed the request gets a 503 and rank 0 exits.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import trio
from distributed_ranks import GREEDY, PROMPT, collect, exact_job, generate_argv
from forked_ranks import Job
from helpers_server import serving

from pipeline.cli import main
from pipeline.config.errors import ConfigError
from pipeline.config.loading import config_from_dict
from pipeline.distributed import wire
from pipeline.distributed.errors import RankLost
from pipeline.distributed.link import Link
from pipeline.distributed.plan import (
    PlanError,
    check_boundaries,
    equal_boundaries,
    plan_for,
    share_weights,
    weighted_boundaries,
    with_moe_layers,
)
from pipeline.engine import open_engine
from qpack.families.qwen3_5_moe import EOS, IM_END
from qpack.synth.presets import get_preset
from qpack.synth.tokenizer import TokenizerSpec

TIMEOUT = 120  # generous: the ranks share two cores with the rest of the suite


# -- the split and the wire (no processes) -------------------------------------------------


def test_layers_split_by_count_weight_or_boundaries() -> None:
    assert equal_boundaries(48, 2) == [24]
    assert equal_boundaries(4, 3) == [2, 3]  # the extra layer goes to the first rank
    assert equal_boundaries(40, 3) == [14, 27]
    assert weighted_boundaries(48, [1.0, 3.0]) == [12]
    assert weighted_boundaries(4, [100.0, 1.0]) == [3]  # every rank keeps one layer
    assert check_boundaries(48, 3, [10, 30]) == [10, 30]
    plan = plan_for(1, 3, 48, [10, 30])
    assert plan.layers == range(10, 30) and not plan.first and not plan.last
    # Half memory, half disk: a rank with twice the memory and the same disk gets 2/3 + 1/2.
    assert share_weights([64000, 128000], [2000, 2000]) == pytest.approx([5 / 12, 7 / 12])
    with pytest.raises(PlanError, match="only 4 layers"):
        equal_boundaries(4, 5)
    with pytest.raises(PlanError, match="rise strictly"):
        check_boundaries(48, 3, [30, 10])
    with pytest.raises(PlanError, match="2 ranks need 1"):
        check_boundaries(48, 2, [10, 20])
    # Every rank runs a MoE layer: DeepSeek's first dense layers do not make a rank.
    assert with_moe_layers(equal_boundaries(3, 2), 3, [1, 2]) == [2]
    assert with_moe_layers([2, 4], 6, [3, 4, 5]) == [4, 5]
    assert with_moe_layers([20, 40], 61, list(range(3, 61))) == [20, 40]
    # MoE layers first and dense ones last, or interleaved: boundaries move left too.
    assert with_moe_layers(equal_boundaries(6, 3), 6, [0, 1, 5]) == [1, 4]
    assert with_moe_layers([4], 8, [0, 1, 2, 3]) == [3]
    with pytest.raises(PlanError, match="only 2 MoE layers"):
        with_moe_layers([1, 2], 3, [1, 2])
    with pytest.raises(PlanError, match="give rank 0 layers 0-0, none of them a MoE layer"):
        with_moe_layers([1], 3, [1, 2], given=True)


def test_the_probes_a_weighted_split_uses(synth_checkpoint, packed) -> None:
    from pipeline.distributed.probe import free_memory_mb, kept_bytes, read_speed_mb_s
    from qpack.reader import Container

    container = Container.open(packed(synth_checkpoint("qwen3_next"), bits=None))
    try:
        assert free_memory_mb() > 0 and read_speed_mb_s(container) > 0
        dense = container.manifest.dense_bytes
        assert 0 <= dense - kept_bytes(container.dense_path, lambda name: True) < 65536  # header
        layers = kept_bytes(container.dense_path, lambda name: ".layers." in name)
        assert 0 < layers < dense
    finally:
        container.close()


def test_ranks_on_one_machine_split_its_memory_for_their_pools() -> None:
    from pipeline.distributed.probe import host_id
    from pipeline.engine_sizing import default_slots

    gib, mib = 2**30, 2**20
    # Half of what is left after the dense core and 1 GiB, in 1 MiB slots.
    assert default_slots(10 * gib, gib, mib) == 4096
    # Two ranks here: each takes half of its half of the machine.
    assert default_slots(10 * gib, gib, mib, processes=2) == 1536
    assert default_slots(gib, gib, mib, processes=4) == 1  # never below one slot
    assert host_id() == host_id() and 0 <= host_id() < 2**24  # exact in float32


def test_a_peer_that_never_answers_breaks_the_link_once() -> None:
    # What rank 0 sees when a rank hangs: the wait ends at the deadline with RankLost,
    # the link is marked broken (the stuck thread is abandoned), later calls fail at once.
    told: list[str] = []
    link = Link()
    link.on_broken = lambda: told.append("lost")
    assert link.call(lambda: 7, timeout=5, what="test") == 7
    release = threading.Event()
    with pytest.raises(RankLost, match="no answer from the other ranks within 0.2 s"):
        link.call(release.wait, timeout=0.2, what="forward")
    start = time.monotonic()
    with pytest.raises(RankLost):
        link.call(lambda: 7, timeout=5, what="test")
    assert time.monotonic() - start < 0.1 and told == ["lost"]
    release.set()
    # A distributed op failing (the ring's "connection to a peer was lost") breaks it too.
    other = Link()

    def lost() -> None:
        raise RuntimeError("[ring] connection to a peer was lost")

    with pytest.raises(RankLost, match="peer was lost"):
        other.call(lost, timeout=5, what="forward")
    assert other.broken is not None


def test_the_doorbell_keeps_its_neighbours_connection_probed(tmp_path, monkeypatch) -> None:
    # A neighbour's machine lost sends nothing: keepalive fails the idle connection a
    # later rank waits on (the options are set on the ring's own socket, not a copy).
    import socket

    from pipeline.distributed.doorbell import KEEPALIVE, Doorbell

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        (tmp_path / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{port}"]]))
        monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
        with socket.create_connection(("127.0.0.1", port)) as left:
            accepted, _ = server.accept()
            with accepted:
                assert not accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                bell = Doorbell.for_rank(0)
                try:
                    assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                    if hasattr(socket, "TCP_KEEPIDLE"):
                        assert (accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                                accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                                accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)) \
                            == KEEPALIVE
                    assert not left.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                    left.sendall(b"x")
                    assert bell.wait(5)  # and it still rings
                finally:
                    bell.close()


def test_gpu_per_rank_shows_rank_r_only_gpu_r(monkeypatch) -> None:
    from pipeline.distributed.gpu import pin_gpu_per_rank

    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pin_gpu_per_rank()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_header_and_the_bits_round_trip() -> None:
    header = wire.Header(wire.Command.FORWARD, seq=7, tokens=3, all_positions=True, decode=False,
                         dtype=1, hidden=2048, rows=3, key=11)
    assert wire.Header.decode_from(header.encode()) == header
    for dtype in wire.DTYPES:
        x = (mx.arange(12, dtype=mx.float32) / 7).astype(dtype).reshape(1, 3, 4)
        back = wire.from_bits(wire.to_bits(x), dtype)
        assert back.dtype == dtype and mx.array_equal(back, x).item()


def test_the_distributed_section_is_checked() -> None:
    cfg = config_from_dict({"model": {"path": "synth:tiny"},
                            "distributed": {"enabled": True, "boundaries": [24]}})
    assert cfg.distributed.enabled and cfg.distributed.boundaries == (24,)
    with pytest.raises(ConfigError, match="distributed.split"):
        config_from_dict({"model": {"path": "synth:tiny"}, "distributed": {"split": "random"}})


def test_distributed_without_a_launcher_is_one_error_line(synth_checkpoint, packed, capsys,
                                                          monkeypatch) -> None:
    container = packed(synth_checkpoint("qwen3_next"), bits=None)
    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    capsys.readouterr()  # the fixtures' logs
    assert main(["generate", str(container), "--distributed"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot join the distributed job"), err
    assert "mlx.launch" in err and "Traceback" not in err and err.count("\n") == 1


# -- real jobs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def containers(synth_checkpoint, packed) -> list[Path]:
    return [packed(synth_checkpoint("qwen3_next"), bits=None),
            packed(synth_checkpoint("qwen3_5_moe", dtype="bfloat16"), bits=4),
            packed(synth_checkpoint("deepseek_v3", dtype="float32"), bits=16)]


async def _one_process(path: Path) -> dict[str, np.ndarray]:
    from distributed_ranks import config

    async with open_engine(config(path, distributed=False)) as engine:
        return await collect(engine)


def test_three_ranks_give_one_process_logits(fork_server, containers, tmp_path, capsys) -> None:
    # Qwen3-Next, and DeepSeek-V3 (MLA caches; rank 0 runs its dense first layer and one
    # MoE layer); the Qwen3.5 MoE family (4-bit) in the two-rank test below.
    paths = [containers[0], containers[2]]
    job = Job(fork_server, 3, tmp_path, ([str(p) for p in paths], str(tmp_path)),
              target=exact_job)
    try:
        # The reference runs here meanwhile, on the whole model in this process.
        expected = [trio.run(_one_process, path) for path in paths]
        capsys.readouterr()
        assert main(generate_argv(paths[0])) == 0  # the CLI face, one process
        text = capsys.readouterr().out.strip()
        assert job.wait(TIMEOUT) == [0, 0, 0], job.outputs()
    finally:
        job.kill()
    for path, want in zip(paths, expected, strict=True):
        got = np.load(tmp_path / f"{path.parent.name}.npz")
        assert sorted(got.files) == sorted(want)
        for name in want:  # bit for bit: the same kernels over the same weights
            assert np.array_equal(got[name], want[name]), (path, name)
        assert len(got["greedy"]) == GREEDY
        # In the decode batch a row's tokens are those it gets alone (a is the greedy prompt).
        assert list(got["batch_a_ids"][:GREEDY]) == list(got["greedy"])
        # The prefix cache across ranks: the follow-up turn restarts after the first
        # generation's tokens, the batched a after the prompt's checkpoint.
        assert got["follow_cached"] == len(PROMPT) + GREEDY - 1
        assert got["batch_a_cached"] == len(PROMPT) - 1
    stats = np.load(tmp_path / f"{containers[0].parent.name}.stats.npz")
    assert list(stats["layers"]) == [0, 1]  # rank 0's slice of 4 layers among 3 ranks
    assert stats["ranks_on_host"] == 3  # all on localhost: they split its memory
    assert stats["largest_batch"] >= 2  # the batch crossed the ranks, regrouping on the way
    assert stats["max_batch"] == 8 // stats["top_k"]  # what the later ranks' 8 slots can pin
    # Rank 0 loaded only its layers and the embedding (no other layer, no final norm, no head).
    assert stats["other_layers_elements"] == 0
    assert 0 < stats["dense_bytes"] < 0.8 * stats["container_dense_bytes"]
    log = job.outputs()
    assert "distributed.stats" in log and "distributed.stage_done" in log
    assert text and text in job.ranks[0].output()  # `generate --distributed` printed the same


async def _greedy_in_one_process(path: Path) -> dict[str, np.ndarray]:
    from distributed_ranks import collect_greedy, config

    async with open_engine(config(path, distributed=False)) as engine:
        return await collect_greedy(engine)


def test_two_ranks_split_glm_as_one_process(fork_server, synth_checkpoint, packed, tmp_path) -> None:
    """GLM-4.5 (a dense first layer, shared experts, grouped routing): rank 0 runs the dense
    layer and the first MoE layer, rank 1 the other; the logits of the prompt and of decode
    steps bit for bit, and the greedy tokens, are one process's. Only these (the decode
    batch and the prefix cache across ranks run on DeepSeek's split above): a two-rank job
    of its own costs ~4 s here."""
    from distributed_ranks import greedy_job

    path = packed(synth_checkpoint("glm4_moe", dtype="float32"), bits=16)
    job = Job(fork_server, 2, tmp_path, (str(path), str(tmp_path)), target=greedy_job)
    try:
        want = trio.run(_greedy_in_one_process, path)
        assert job.wait(TIMEOUT) == [0, 0], job.outputs()
    finally:
        job.kill()
    got = np.load(tmp_path / "greedy.npz")
    assert list(got["layers"]) == [0, 1]
    assert len(want["greedy"]) == GREEDY
    for name in want:
        assert np.array_equal(got[name], want[name]), name


async def _served_by_one_process(container: Path, body: dict) -> dict:
    async with serving(container, prefill_chunk=2) as (_, port):
        status, reply = await trio.to_thread.run_sync(_post, port, body)
    assert status == 200, reply
    return reply


def _post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_two_ranks_serve_and_a_killed_rank_ends_with_503(fork_server, containers) -> None:
    # The job as a service manager runs it: `moestream launch` (tests/forked_launch.py).
    from forked_launch import Launched

    from pipeline.server.serve import check_bindable

    container = containers[1]
    tok = TokenizerSpec("qwen3_5_moe", ranks=get_preset("qwen3_5_moe", "tiny").bpe_ranks)
    argv = ["--log-level", "info", "serve", str(container), "--distributed", "--port", "0",
            "--slots", "8", "--prefill-chunk", "2"]  # any free port, read from server.listening
    job = Launched(fork_server, 2, argv)
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": GREEDY, "temperature": 0,
                "logprobs": 3}
        expected = trio.run(_served_by_one_process, container, body)
        port = int(re.search(r"port=(\d+)", job.wait_for("server.listening", TIMEOUT))[1])
        status, reply = _post(port, body)
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == GREEDY
        # The text and every log-probability one process serves: the same logits.
        assert reply["choices"] == expected["choices"]
        # n = 2: two rows of one decode batch across the ranks, each the lone run's.
        status, two = _post(port, {**body, "n": 2})
        assert status == 200, two
        alone = {k: v for k, v in expected["choices"][0].items() if k != "index"}
        assert [{k: v for k, v in c.items() if k != "index"} for c in two["choices"]] == [alone] * 2
        # A client that leaves mid-stream cancels the generation between two forwards; the
        # next request starts fresh caches on both ranks (a new sequence id): same reply.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 500,
                     "stream": True, "logprobs": None}), {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        chunks = 0
        while chunks < 4:  # a few tokens in, then gone
            line = stream.readline()
            assert line, "the stream ended early"
            chunks += line.startswith(b"data: ")
        conn.close()
        # Ctrl-C in mlx.launch's terminal reaches every local rank: a later rank leaves
        # the decision to rank 0 (here: none; it serves on).
        os.kill(job.ranks[1], signal.SIGINT)
        status, again = _post(port, body)
        assert status == 200 and again["choices"] == expected["choices"], again

        # A long request in flight when rank 1 dies: it ends with a 503, not a hang.
        # EOS banned: the tiny model's vocabulary is small enough for greedy to meet it early.
        eos = {str(tok.token_id(i)): -100 for i in (EOS, IM_END)}
        long = {**body, "max_tokens": 2000, "logprobs": None, "logit_bias": eos}
        answer: list[tuple[int, dict]] = []
        asker = threading.Thread(target=lambda: answer.append(_post(port, long)), daemon=True)
        asker.start()
        time.sleep(1.0)  # well into its decode (tens of tokens a second here)
        os.kill(job.ranks[1], signal.SIGKILL)
        start = time.monotonic()
        asker.join(60)
        status, reply = answer[0]
        assert status == 503, reply
        assert reply["error"]["code"] == "rank_lost" and "rank" in reply["error"]["message"]
        # No hang: rank 0 stops by itself, the launcher follows, nothing is left, the port
        # is free again; the job's status is the first failure's (rank 1's SIGKILL).
        assert job.gone_within(30), job.output()[-4000:]
        assert time.monotonic() - start < 30
        log = job.output()
        assert "rank=1 status=137" in log and "rank=0 status=1" in log, log[-4000:]
        assert job.proc.exitcode == 128 + signal.SIGKILL
        assert "error: rank 0: a rank was lost" in log, log[-4000:]
        check_bindable("127.0.0.1", port)
    finally:
        job.kill()
