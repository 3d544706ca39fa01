"""The packer against independent references: mlx-lm's own sanitize/convert path for the
dense core, mx.load + mx.quantize for the expert blobs, and an uninterrupted pack for
resumed ones."""

from __future__ import annotations

import json
import re
import signal
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map_with_path
from packjob import PackJob, check_half_written, files, pack_on_a_full_disk

from qpack import spec
from qpack.mlx_model import model_classes
from qpack.reader import Container
from qpack.spec import JOURNAL, QpackError
from qpack.writer import pack


def _source_weights(src: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for shard in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
    return weights


def _stacked_experts(src: Path) -> dict[int, dict[str, mx.array]]:
    """layer -> "{proj}.{part}" -> [E, ...], via mlx-lm's own sanitize where it can read the
    layout, else (transformers-5 text-only) by stacking the per-expert tensors."""
    config = json.loads((src / "config.json").read_text())
    weights = _source_weights(src)
    if config["model_type"] == "qwen3_5_moe_text":
        n = config["num_experts"]
        out: dict[int, dict[str, mx.array]] = {}
        for layer in range(config["num_hidden_layers"]):
            out[layer] = {
                f"{p}.weight": mx.stack([weights[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"] for e in range(n)])
                for p in spec.PROJECTIONS
            }
        return out
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    if "quantization" not in config:
        weights = model.sanitize(weights)
    out = {}
    for name, arr in weights.items():
        if ".switch_mlp." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            out.setdefault(layer, {})[name.split(".switch_mlp.")[1]] = arr
    return out


def _u8(arr: mx.array) -> np.ndarray:
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.asarray(arr).reshape(-1).view(np.uint8)


CASES = [
    ("qwen3_next", "hub", "bfloat16", 4),
    ("qwen3_next", "hub", "bfloat16", 8),
    ("qwen3_next", "hub", "float32", 16),
    ("qwen3_5_moe", "hub", "bfloat16", 4),
    ("qwen3_5_moe", "hub", "bfloat16", 8),
    ("qwen3_5_moe", "hub", "float32", 16),
    ("qwen3_5_moe", "per-expert", "bfloat16", 4),
    ("qwen3_5_moe", "per-expert", "float32", 16),
]


@pytest.mark.parametrize(("family", "layout", "dtype", "bits"), CASES)
def test_expert_blobs_equal_source(synth_checkpoint, packed, family, layout, dtype, bits):
    src = synth_checkpoint(family, dtype=dtype, layout=layout)
    out = packed(src, bits=bits)
    stacked = _stacked_experts(src)
    with Container.open(out, verify="full") as c:
        m = c.manifest
        assert sorted(stacked) == c.moe_layers
        for entry in m.layers:
            assert entry.stride == spec.round_up(entry.format.nbytes, spec.ALIGNMENT)
            assert (out / entry.file).stat().st_size == entry.stride * m.num_experts
            expected: dict[str, mx.array] = {}
            for p in spec.PROJECTIONS:
                w = stacked[entry.index][f"{p}.weight"]
                if bits == 16:
                    expected[f"{p}.weight"] = w
                else:
                    wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
                    expected.update({f"{p}.weight": wq, f"{p}.scales": scales, f"{p}.biases": biases})
            assert {t.name for t in entry.format.tensors} == set(expected)
            buf = np.zeros(entry.stride, np.uint8)
            for e in range(m.num_experts):
                c.read_expert(entry.index, e, buf)
                assert zlib.crc32(buf[: entry.format.nbytes]) == entry.checksums[e]
                assert not buf[entry.format.nbytes :].any(), "padding must be zeros"
                for t in entry.format.tensors:
                    got = buf[t.offset : t.offset + t.nbytes]
                    assert np.array_equal(got, _u8(expected[t.name][e])), (entry.index, e, t.name)
        assert m.top_k == 4 and m.num_experts == 16 and m.num_layers == 4
        assert m.quantization.bits == (None if bits == 16 else bits)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_mlx_quantized_source_packs_like_the_float_source(synth_checkpoint, packed, family):
    """Copying MLX-quantized bytes and quantizing the bf16 source must agree byte for byte:
    mlx_lm.convert quantizes with the same mx.quantize calls we make per expert."""
    from_mlx = packed(synth_checkpoint(family, dtype="bfloat16", bits=4))
    from_bf16 = packed(synth_checkpoint(family, dtype="bfloat16"), bits=4)
    m = Container.open(from_mlx).manifest
    assert m.quantization == Container.open(from_bf16).manifest.quantization
    for rel in [spec.DENSE, *(entry.file for entry in m.layers)]:
        assert (from_mlx / rel).read_bytes() == (from_bf16 / rel).read_bytes(), rel


def test_mlx_source_is_never_requantized(synth_checkpoint, tmp_path):
    src = synth_checkpoint("qwen3_next", dtype="bfloat16", bits=4)
    with pytest.raises(QpackError, match="never re-quantizes"):
        pack(src, tmp_path / "x.qpack", bits=8, progress=False)


def _convert_reference(src: Path, bits: int | None):
    """What mlx_lm.convert would hold in memory before saving: load, cast, quantize."""
    # Imported here: mlx_lm.utils pulls in transformers and torch (~3 s of CPU a process).
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(src)
    dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if dtype in ("float16", "bfloat16", "float32"):
        target = getattr(mx, dtype)
        cast_ok = getattr(model, "cast_predicate", lambda _: True)

        def set_dtype(k, v):
            return v.astype(target) if cast_ok(k) and mx.issubdtype(v.dtype, mx.floating) else v

        model.update(tree_map_with_path(set_dtype, model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    return model, config


def _load_container_dense(root: Path):
    config = json.loads((root / spec.CONFIG).read_text())
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = mx.load(str(root / spec.DENSE))
    if q := config.get("quantization"):
        # mlx_lm.utils.load_model's own rule: per-path entries, else quantized iff scales exist
        def predicate(path, module):
            if path in q:
                return q[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q["mode"], class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=False)
    return model, config, weights


@pytest.mark.parametrize(("family", "dtype", "bits"), [
    ("qwen3_next", "bfloat16", 4), ("qwen3_next", "float32", 16),
    ("qwen3_5_moe", "bfloat16", 8), ("qwen3_5_moe", "float32", 16),
])
def test_dense_core_loads_into_mlx_lm_and_matches_it(synth_checkpoint, packed, family, dtype, bits):
    src = synth_checkpoint(family, dtype=dtype)
    out = packed(src, bits=bits)
    ref, ref_config = _convert_reference(src, None if bits == 16 else bits)
    model, config, weights = _load_container_dense(out)
    ref_params = {k: v for k, v in tree_flatten(ref.parameters()) if ".switch_mlp." not in k}
    params = dict(tree_flatten(model.parameters()))
    assert set(weights) == set(ref_params)
    for name, want in ref_params.items():
        got = params[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert mx.array_equal(got, want).item(), name
    if bits != 16:
        assert config["quantization"] == ref_config["quantization"]


def test_text_only_layout_packs_like_the_hub_layout(synth_checkpoint, packed):
    hub = packed(synth_checkpoint("qwen3_5_moe", dtype="bfloat16"), bits=4)
    text = packed(synth_checkpoint("qwen3_5_moe", dtype="bfloat16", layout="per-expert"), bits=4)
    assert json.loads((text / spec.CONFIG).read_text())["model_type"] == "qwen3_5_moe"
    for rel in [spec.DENSE, *(spec.layer_file(i) for i in range(4))]:
        assert (hub / rel).read_bytes() == (text / rel).read_bytes(), rel


# -- interrupted packs ------------------------------------------------------------
# Packs run in the shared fork server and stop at named milestones (tests/packjob.py);
# tests/test_faults_pack.py kills at seeded random milestones, this file at chosen ones.

# (milestone, signal): each kill lands exactly there, with nothing racing on. Every kind
# of milestone (begin, wrote, renamed, journal-tmp, journal) is among them.
KILL_POINTS = [
    ("journal start", signal.SIGKILL),  # as early as possible: nothing but the journal
    (f"wrote {spec.DENSE} 3", signal.SIGTERM),  # a dense .partial with some tensors written
    ("wrote experts/layer_001.bin 7", signal.SIGINT),  # a layer .partial half full
    ("renamed experts/layer_002.bin", signal.SIGKILL),  # just renamed, not yet in the journal
    ("journal experts/layer_002.bin", signal.SIGINT),  # ... and now in it
    ("journal-tmp experts/layer_003.bin", signal.SIGKILL),  # journal written, not yet renamed
    # The MTP head's experts done, its dense part not: the resumed manifest's mtp_experts
    # comes from the journal.
    (f"journal {spec.MTP_EXPERTS_FILE}", signal.SIGTERM),
    (f"begin {spec.MANIFEST}", signal.SIGTERM),  # everything but the manifest
]
EXIT_CODES = {signal.SIGKILL: -9, signal.SIGTERM: -15, signal.SIGINT: 128 + signal.SIGINT}


def test_pack_killed_at_several_points_resumes_byte_identical(synth_checkpoint, packed, fork_server,
                                                               tmp_path):
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    reference = packed(src, bits=4)
    out = tmp_path / "killed.qpack"
    for milestone, sig in KILL_POINTS:
        job = PackJob(fork_server, src, out, stop_at=milestone)
        job.wait_paused()
        assert job.kill(sig) == EXIT_CODES[sig]
        assert not (out / spec.MANIFEST).exists()
        check_half_written(out)
    pack(src, out, bits=4, progress=False)
    assert not (out / JOURNAL).exists()
    assert files(out) == files(reference)


def test_resume_with_other_options_is_refused(synth_checkpoint, fork_server, tmp_path):
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    out = tmp_path / "x.qpack"
    job = PackJob(fork_server, src, out, stop_at="begin experts/layer_000.bin")
    job.wait_paused()
    job.kill(signal.SIGKILL)
    with pytest.raises(QpackError, match="other options"):
        pack(src, out, bits=8, progress=False)


def test_full_disk_stops_naming_the_file_and_resumes_when_space_is_back(synth_checkpoint, packed,
                                                                        fork_server, tmp_path):
    """A real ENOSPC: a tmpfs in a private mount namespace with room for the pack when it
    starts (the free-space check passes), filled by another thread mid-pack."""
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    reference = packed(src, bits=4)
    result, (code1, err1, tmp_left), (code2, err2) = pack_on_a_full_disk(fork_server, src, tmp_path)
    assert (code1, code2) == (2, 0), (err1, err2)
    assert re.search(r"error: \S+: disk full \(ENOSPC\) while writing; free space and re-run", err1)
    assert not tmp_left, "a torn journal .tmp was left behind"
    assert files(result) == files(reference)


def test_pack_subcommand_with_verify_after(synth_checkpoint, tmp_path, capsys):
    import argparse

    from pipeline.cli.pack import register

    parser = argparse.ArgumentParser(prog="moestream")
    register(parser.add_subparsers())
    out = tmp_path / "cli.qpack"
    src = synth_checkpoint("qwen3_5_moe", dtype="float32", layout="per-expert")
    args = parser.parse_args(["pack", str(src), "-o", str(out), "--bits", "8", "--dtype", "bfloat16",
                              "--no-progress", "--verify-after"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "MB/s" in text and "verified:" in text
    m = Container.open(out).manifest
    assert m.model_type == "qwen3_5_moe" and m.quantization.bits == 8
    assert m.layers[0].format.tensor("gate_proj.scales").dtype == "bfloat16"  # --dtype applied first
    assert args.func(args) == 0  # a finished container: nothing to do
    args = parser.parse_args(["pack", str(tmp_path / "no-such-dir"), "-o", str(tmp_path / "y.qpack")])
    assert args.func(args) == 2
    assert "neither a checkpoint directory nor a hub repo id" in capsys.readouterr().err


def test_a_finished_container_is_returned_only_to_the_same_pack(synth_checkpoint, tmp_path):
    """Re-running the same pack finds it done; another source or other bits into the same
    -o are refused in one line (they got the old container back, silently)."""
    src = synth_checkpoint("qwen3_next")
    out = tmp_path / "b16.qpack"
    pack(src, out, bits=16, progress=False)
    assert pack(src, out, bits=16, progress=False).bytes_written == 0  # already complete
    with pytest.raises(QpackError, match=r"other options .*'bits': \(None, 4\)"):
        pack(src, out, bits=4, progress=False)
    with pytest.raises(QpackError, match="other options .*'source'"):
        pack(synth_checkpoint("qwen3_5_moe"), out, bits=16, progress=False)
