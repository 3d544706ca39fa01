"""Checkpoints as users download them (qpack/synth/wild.py derives each layout from a tiny
synthetic checkpoint): normalised and packed to the same container as the plain layout, or
refused with one line before any weight is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_forward import tiny_pair
from helpers_hub import REPO_ID, FakeHub, use_hub

from qpack import spec
from qpack.spec import QpackError
from qpack.synth.wild import derive
from qpack.writer import pack


def _payload(container: Path) -> dict[str, str]:
    """sha256 of every file but manifest and config (which name the source)."""
    manifest = json.loads((container / spec.MANIFEST).read_text())
    return {f["path"]: f["sha256"] for f in manifest["files"] if f["path"] != spec.CONFIG}


def test_transformers5_rope_parameters_config(synth_checkpoint, packed, tmp_path: Path) -> None:
    src, plain = tiny_pair(synth_checkpoint, packed, "qwen3_next")  # fp32, bits 16
    wild = derive(src, tmp_path / "tf5", "tf5-rope")
    assert "rope_theta" not in json.loads((wild / "config.json").read_text())
    # Before: mlx-lm's ModelArgs raised "missing rope_theta" while planning the pack.
    out = pack(wild, tmp_path / "tf5.qpack", bits=16, progress=False).path
    assert _payload(out) == _payload(plain)
    config = json.loads((out / spec.CONFIG).read_text())
    source = json.loads((src / "config.json").read_text())
    assert (config["rope_theta"], config["partial_rotary_factor"]) == (
        source["rope_theta"], source["partial_rotary_factor"])


def test_mlx_layout_with_language_model_vision_tower(synth_checkpoint, packed,
                                                    tmp_path: Path) -> None:
    src, plain = tiny_pair(synth_checkpoint, packed, "qwen3_5_moe", 4)  # MLX 4-bit
    wild = derive(src, tmp_path / "vt", "mlx-vision-tower")
    out = pack(wild, tmp_path / "vt.qpack", progress=False).path
    # The tower is dropped: dense.safetensors is the text model's, byte for byte.
    assert _payload(out) == _payload(plain)


def test_hub_skips_vision_only_shards_and_fetches_the_mtp_head(synth_checkpoint, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = synth_checkpoint("qwen3_5_moe", dtype="bfloat16")
    wild = derive(src, tmp_path / "hub", "extra-shards")
    hub = use_hub(FakeHub(wild, cut=False), tmp_path, monkeypatch)
    try:
        out = pack(REPO_ID, tmp_path / "remote.qpack", bits=4, progress=False).path
    finally:
        hub.close()
    fetched = {r[1].rsplit("/", 1)[-1] for r in hub.requests if r[0] == "GET"}
    assert "model-visual.safetensors" not in fetched
    assert {n for n in fetched if n.endswith(".safetensors")} == {
        "model-mtp.safetensors", *(p.name for p in src.glob("*.safetensors"))}
    assert _payload(out) == _payload(pack(wild, tmp_path / "local.qpack", bits=4, progress=False).path)


@pytest.mark.parametrize("kind, message", [
    ("gptq", "GPTQ checkpoints \\(quantization_config.quant_method 'gptq'\\) are not supported; "
             "moestream packs bf16/f16/f32 safetensors"),
    ("awq", "AWQ checkpoints \\(quantization_config.quant_method 'awq'\\) are not supported"),
    ("fp8-per-tensor", "FP8 checkpoint with per-tensor scales \\(no 2-D weight_block_size\\) is not supported"),
    ("gguf", "holds GGUF files, which moestream does not pack"),
])
def test_refused_before_any_weight_is_downloaded(synth_checkpoint, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 kind: str, message: str) -> None:
    wild = derive(synth_checkpoint("qwen3_next"), tmp_path / kind, kind)
    with pytest.raises(QpackError, match=message):
        pack(wild, tmp_path / "local.qpack", progress=False)
    hub = use_hub(FakeHub(wild, cut=False), tmp_path, monkeypatch)
    try:
        with pytest.raises(QpackError, match=f"{REPO_ID}: {message}"):
            pack(REPO_ID, tmp_path / "remote.qpack", progress=False)
    finally:
        hub.close()
    fetched = [r[1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert not [p for p in fetched if p.endswith((".safetensors", ".gguf"))], fetched
    assert not (tmp_path / "remote.qpack").exists()
