"""The container reader: one positional read per expert, short reads, threads, checksums,
views, sizes; and the verify/info subcommands through their registered parser."""

from __future__ import annotations

import argparse
import json
import os
import threading
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pipeline.cli.pack import register
from qpack import spec
from qpack.reader import Container, ExpertCorrupt, PosixIO, verify_container
from qpack.spec import QpackError


@pytest.fixture
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)


class CountingIO(PosixIO):
    """Real preads, at most `chunk` bytes each: the reader must keep reading until done."""

    def __init__(self, chunk: int | None = None) -> None:
        self.chunk = chunk
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        with self.lock:
            self.calls.append((offset, len(buf)))
        if self.chunk is not None:
            buf = buf[: self.chunk]
        return super().pread_into(fd, buf, offset)


def test_one_read_per_expert_of_the_full_stride(container):
    io = CountingIO()
    with Container.open(container, io=io) as c:
        entry = c.layer(c.moe_layers[1])
        buf = np.zeros(entry.stride, np.uint8)
        c.read_expert(entry.index, 5, buf)
        assert io.calls == [(5 * entry.stride, entry.stride)]
        raw = (container / entry.file).read_bytes()
        assert buf.tobytes() == raw[5 * entry.stride : 6 * entry.stride]


def test_short_reads_are_retried_until_complete(container):
    io = CountingIO(chunk=1000)
    with Container.open(container, io=io) as c:
        entry = c.layer(0)
        buf = bytearray(entry.stride)
        c.read_expert(0, 3, memoryview(buf))
        assert len(io.calls) == -(-entry.stride // 1000)
        assert zlib.crc32(buf[: entry.format.nbytes]) == entry.checksums[3]


def test_buffer_of_payload_size_reads_only_the_payload(container):
    io = CountingIO()
    with Container.open(container, io=io) as c:
        entry = c.layer(0)
        c.read_expert(0, 0, bytearray(entry.format.nbytes))
        assert io.calls == [(0, entry.format.nbytes)]
        with pytest.raises(ValueError, match="smaller than the expert"):
            c.read_expert(0, 0, bytearray(entry.format.nbytes - 1))
        with pytest.raises(ValueError, match="writable"):
            c.read_expert(0, 0, memoryview(bytes(entry.stride)))
        with pytest.raises(IndexError):
            c.read_expert(0, entry.num_experts, bytearray(entry.stride))
        with pytest.raises(KeyError, match="no routed experts"):
            c.read_expert(99, 0, bytearray(entry.stride))


def test_many_threads_read_concurrently(container):
    with Container.open(container) as c:
        m = c.manifest
        want = {}
        for entry in m.layers:
            raw = (container / entry.file).read_bytes()
            for e in range(m.num_experts):
                want[(entry.index, e)] = raw[e * entry.stride : e * entry.stride + entry.format.nbytes]
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            buf = np.zeros(m.max_stride, np.uint8)
            try:
                for _ in range(200):
                    key = (int(rng.choice(c.moe_layers)), int(rng.integers(m.num_experts)))
                    c.read_expert(*key, buf)
                    assert buf[: len(want[key])].tobytes() == want[key]
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert len(c._fds) == len(m.layers)  # one descriptor per layer file, however many threads


def test_expert_views_match_mx_quantize_of_the_source(synth_checkpoint, container):
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    weights = {}
    for shard in src.glob("*.safetensors"):
        weights.update(mx.load(str(shard)))
    with Container.open(container) as c:
        entry = c.layer(2)
        buf = np.zeros(entry.stride, np.uint8)
        c.read_expert(2, 7, buf)
        views = c.expert_views(buf, 2)
        w = weights["model.layers.2.mlp.experts.7.down_proj.weight"]
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        assert views["down_proj.weight"].dtype == np.uint32
        assert np.array_equal(views["down_proj.weight"], np.asarray(wq))
        assert views["down_proj.scales"].dtype == np.uint16  # bfloat16 bits
        assert np.array_equal(views["down_proj.scales"], np.asarray(scales.view(mx.uint16)))
        assert np.array_equal(views["down_proj.biases"], np.asarray(biases.view(mx.uint16)))
        views["gate_proj.weight"][0, 0] = 12345  # a view, not a copy
        assert buf[: 4].view(np.uint32)[0] == 12345


def test_sizes_and_dense_weights(container):
    with Container.open(container) as c:
        m = c.manifest
        assert c.smallest_pool_bytes == m.top_k * m.max_stride
        assert c.prefill_pool_bytes(1) == m.top_k * m.max_stride
        assert c.prefill_pool_bytes(10_000) == m.num_experts * m.max_stride
        dense = c.dense_weights()
        assert "model.embed_tokens.weight" in dense and "model.layers.0.mlp.gate.scales" in dense
        assert not any(".switch_mlp." in k for k in dense)
        assert c.config["quantization"]["bits"] == 4
        assert c.dense_path.stat().st_size == m.dense_bytes


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_crc_checked_on_first_use_only_when_asked(container, tmp_path):
    import shutil

    bad = tmp_path / "bad.qpack"
    shutil.copytree(container, bad)
    entry = Container.open(bad).layer(1)
    _flip_byte(bad / entry.file, 4 * entry.stride + 10)
    buf = bytearray(entry.stride)
    with Container.open(bad) as c:
        c.read_expert(1, 3, buf)  # a clean neighbour
        with pytest.raises(ExpertCorrupt, match=r"layer 1 expert 4: crc32"):
            c.read_expert(1, 4, buf)
    with Container.open(bad, verify="off") as c:
        c.read_expert(1, 4, buf)  # caller opted out
    with pytest.raises(QpackError, match="verification failed"):
        Container.open(bad, verify="full")
    report = verify_container(bad)
    assert not report.ok
    assert any("layer 1 expert 4" in p for p in report.problems)
    assert any("sha256" in p and "layer_001.bin" in p for p in report.problems)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream")
    register(p.add_subparsers())
    return p


def test_verify_and_info_subcommands(container, capsys, tmp_path):
    args = _parser().parse_args(["verify", str(container)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("OK ")

    args = _parser().parse_args(["info", str(container), "--json"])
    assert args.func(args) == 0
    info = json.loads(capsys.readouterr().out)
    m = Container.open(container).manifest
    assert info["model_type"] == "qwen3_next" and info["moe_layers"] == 4
    assert info["num_experts"] == m.num_experts and info["top_k"] == m.top_k
    assert info["smallest_pool_bytes"] == m.top_k * m.max_stride
    head = m.mtp_experts  # the MTP head's experts: blobs under experts/, not a layer's
    assert head is not None and info["mtp_streamed"]
    assert info["total_bytes"] == info["dense_bytes"] + info["expert_bytes"] + head.stride * head.num_experts + sum(
        f.size for f in m.files if f.path != spec.DENSE and not f.path.startswith(spec.EXPERTS_DIR))
    assert info["mtp_bytes"] == head.stride * head.num_experts + (container / "mtp.safetensors").stat().st_size

    args = _parser().parse_args(["info", str(container)])
    assert args.func(args) == 0
    assert "smallest pool" in capsys.readouterr().out

    missing = tmp_path / "nothing.qpack"
    args = _parser().parse_args(["verify", str(missing)])
    assert args.func(args) == 2  # nothing to verify: one line, as `info` gives it
    err = capsys.readouterr().err
    assert err == f"error: {missing}: no such container\n", err
    os.makedirs(missing)
    args = _parser().parse_args(["info", str(missing)])
    assert args.func(args) == 2
    assert "incomplete container" in capsys.readouterr().err


def test_a_checkpoint_where_a_container_was_meant_says_to_pack_it(synth_checkpoint) -> None:
    src = synth_checkpoint("qwen3_next")
    with pytest.raises(QpackError, match=r"is a checkpoint directory, not a .qpack container; pack it first: "
                                         r"moestream pack .* -o .*\.qpack"):
        Container.open(src)
