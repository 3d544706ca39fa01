"""FP8 block-scaled checkpoints (the official "-FP8" repos' layout, qpack/synth/wild.py
`fp8-block`) are converted at pack time: e4m3 x block scale -> bf16, then packed like bf16."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers_engine import engine_config

from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.events import Done
from qpack.fp8 import dequantize_rows
from qpack.reader import Container
from qpack.safetensors_io import SafetensorsFile, open_index
from qpack.synth.wild import FP8_BLOCK, derive
from qpack.writer import pack


def _e4m3(q: np.ndarray) -> np.ndarray:
    """float8 e4m3fn -> float32, by the format's definition (independent of MLX)."""
    q = q.astype(np.int32)
    sign = np.where(q & 0x80, -1.0, 1.0)
    exp, man = (q >> 3) & 0xF, q & 0x7
    normal = (1 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * np.exp2(-6.0)
    out = sign * np.where(exp == 0, sub, normal)
    return np.where((exp == 0xF) & (man == 0x7), np.nan, out).astype(np.float32)


def _expected(src: Path, name: str, row: int | None) -> np.ndarray:
    index = open_index(src)
    with SafetensorsFile(index[name]) as f:
        q = np.frombuffer(f.read_bytes(name, row), np.uint8)
        shape = f.tensors[name].shape[1:] if row is not None else f.tensors[name].shape
    with SafetensorsFile(index[name + "_scale_inv"]) as f:
        s_info = f.tensors[name + "_scale_inv"]
        scale = np.frombuffer(f.read_bytes(name + "_scale_inv", row), np.float32).reshape(
            s_info.shape[1:] if row is not None else s_info.shape)
    w = _e4m3(q).reshape(shape)
    b0, b1 = FP8_BLOCK
    s = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[: shape[0], : shape[1]]
    return np.array(mx.array(w * s).astype(mx.bfloat16).astype(mx.float32))


def test_row_chunks_dequantize_like_the_whole_tensor() -> None:
    rng = np.random.default_rng(0)
    data = mx.array(rng.integers(0, 0x7E, size=(70, 50), dtype=np.uint8))
    scale = mx.array(rng.random((3, 2), dtype=np.float32))
    whole = dequantize_rows(data, scale, (32, 48), 0, mx.float32)
    for start, stop in ((0, 7), (7, 40), (40, 70), (33, 34)):
        lo, hi = start // 32, -(-stop // 32)
        part = dequantize_rows(data[start:stop], scale[lo:hi], (32, 48), start, mx.float32)
        assert mx.array_equal(part, whole[start:stop]).item(), (start, stop)


@pytest.mark.parametrize("family, expert", [
    ("qwen3_next", "model.layers.1.mlp.experts.3.down_proj.weight"),
    ("qwen3_5_moe", "model.language_model.layers.1.mlp.experts.down_proj"),  # fused, row 3
])
def test_fp8_repo_packs_to_its_dequantized_weights(synth_checkpoint, tmp_path: Path,
                                                   family: str, expert: str) -> None:
    wild = derive(synth_checkpoint(family, dtype="bfloat16"), tmp_path / "fp8", "fp8-block")
    with SafetensorsFile(open_index(wild)[expert]) as f:
        assert f.tensors[expert].dtype == "F8_E4M3"
    out = pack(wild, tmp_path / "fp8.qpack", bits=16, progress=False).path
    container = Container.open(out)
    try:
        assert "quantization_config" not in json.dumps(container.config)
        entry = container.manifest.layer(1)
        buf = np.empty(entry.stride, dtype=np.uint8)
        container.read_expert(1, 3, buf)
        t = entry.format.tensor("down_proj.weight")
        got = np.array(mx.array(buf[t.offset : t.offset + t.nbytes]).view(mx.bfloat16)
                       .reshape(t.shape).astype(mx.float32))
    finally:
        container.close()
    row = None if ".experts.3." in expert else 3
    np.testing.assert_array_equal(got, _expected(wild, expert, row))


async def test_fp8_repo_quantized_and_streamed(synth_checkpoint, tmp_path: Path) -> None:
    wild = derive(synth_checkpoint("qwen3_next", dtype="bfloat16"), tmp_path / "fp8", "fp8-block")
    out = pack(wild, tmp_path / "q4.qpack", progress=False).path  # default: 4-bit affine
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    async with open_engine(engine_config(out)) as engine:
        events = [e async for e in engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))]
    assert isinstance(events[-1], Done) and len(events[-1].token_ids) == 3
