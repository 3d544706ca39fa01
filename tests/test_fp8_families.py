"""FP8 releases of the families beyond the Qwen hybrids pack to exactly what their
dequantized weights pack to: Qwen3 MoE's and DeepSeek-V3's block-scaled layout
(`weight_scale_inv` per block, qpack/synth/wild.py `fp8-block`), GLM-4.5 / 4.6's
llm-compressor layout (`compressed-tensors`, one bf16 `weight_scale` per output row:
`fp8-channel`) and llm-compressor's FP8_BLOCK scheme (float32 `weight_scale` per block,
static `input_scale`s beside them: `fp8-ct-block`). The reference is a bf16 checkpoint
holding those dequantized weights, computed here from the format's definition (not with
qpack.fp8); both are packed at 4 bits, and the containers' files and the decoded logits
are compared bit for bit. Other compressed-tensors schemes are refused in one line that
names the scheme."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers_forward import DirectForward
from test_fp8 import _e4m3

from qpack.reader import Container
from qpack.safetensors_io import SafetensorsFile, bytes_to_mx
from qpack.source import open_source
from qpack.synth.st_write import TensorEntry, write_safetensors
from qpack.synth.wild import FP8_BLOCK, INDEX, derive
from qpack.writer import pack

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77]


def _dequantized(q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """e4m3 values x their scales, rounded to bf16 (as float32)."""
    w = _e4m3(q).reshape(q.shape)
    if kind in ("fp8-block", "fp8-ct-block"):
        b0, b1 = FP8_BLOCK
        s = np.repeat(np.repeat(scale, b0, axis=-2), b1, axis=-1)[..., : w.shape[-2], : w.shape[-1]]
    else:
        s = scale  # [.., rows, 1]: broadcast along the row
    return np.array(mx.array(w * s).astype(mx.bfloat16).astype(mx.float32))


def _bf16_twin(fp8: Path, out: Path, kind: str) -> Path:
    """`fp8` as a bf16 checkpoint: every e4m3 weight dequantized, its scale dropped."""
    suffix = "_scale_inv" if kind == "fp8-block" else "_scale"
    out.mkdir()
    index = json.loads((fp8 / INDEX).read_text())
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        entries = []
        with SafetensorsFile(fp8 / shard) as f:
            for name, info in f.tensors.items():
                if name.endswith(".input_scale") or (name.endswith(suffix) and name[: -len(suffix)] in f.tensors):
                    continue
                data = bytes(f.read_bytes(name))
                if info.dtype == "F8_E4M3":
                    s = f.tensors[name + suffix]
                    scale = np.array(bytes_to_mx(f.read_bytes(name + suffix), s.dtype, s.shape).astype(mx.float32))
                    w = _dequantized(np.frombuffer(data, np.uint8).reshape(info.shape), scale, kind)
                    data = bytes(memoryview(mx.array(w).astype(mx.bfloat16)))
                    entries.append(TensorEntry(name, "BF16", info.shape, lambda d=data: [d]))
                else:
                    entries.append(TensorEntry(name, info.dtype, info.shape, lambda d=data: [d]))
                weight_map[name] = shard
        write_safetensors(out / shard, entries, {"format": "pt"})
    (out / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}))
    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    for f in fp8.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return out


@pytest.mark.parametrize(("family", "kind", "expert"), [
    ("qwen3_moe", "fp8-block", "model.layers.1.mlp.experts.3.down_proj.weight"),  # Qwen3-30B-A3B-FP8
    ("deepseek_v3", "fp8-block", "model.layers.2.mlp.experts.3.down_proj.weight"),  # DeepSeek-V3
    ("glm4_moe", "fp8-channel", "model.layers.1.mlp.experts.3.down_proj.weight"),  # GLM-4.5-Air-FP8
    ("glm4_moe", "fp8-ct-block", "model.layers.2.mlp.experts.3.gate_proj.weight"),  # llm-compressor FP8_BLOCK
])
def test_an_fp8_release_packs_and_decodes_as_its_dequantized_bf16(
        synth_checkpoint, tmp_path: Path, family: str, kind: str, expert: str) -> None:
    fp8 = derive(synth_checkpoint(family, dtype="bfloat16"), tmp_path / "fp8", kind)
    with SafetensorsFile(open_source(fp8).index[expert]) as f:
        assert f.tensors[expert].dtype == "F8_E4M3"  # the experts too are e4m3 in the release
    if kind == "fp8-ct-block":  # static activation scales beside the weights, never read
        assert expert.removesuffix(".weight") + ".input_scale" in open_source(fp8).index
    twin = _bf16_twin(fp8, tmp_path / "bf16", kind)
    packs = [pack(src, tmp_path / f"{src.name}.qpack", progress=False).path for src in (fp8, twin)]
    files = []
    for path in packs:
        with Container.open(path) as c:
            assert c.manifest.quantization.bits == 4
            files.append({f.path: f.sha256 for f in c.manifest.files})
    assert files[0] == files[1]
    logits = []
    for path in packs:
        ours = DirectForward(path)
        cache = ours.make_cache()
        logits.append([ours.forward(t, cache, all_positions=False)[0] for t in (PROMPT, [5], [4242])])
        ours.close()
    for a, b in zip(*logits, strict=True):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize(("change", "named"), [
    ({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128},
     "int 4-bit weights scaled per group"),  # W4A16 (format pack-quantized in the wild)
    ({"strategy": "tensor"}, "float 8-bit weights scaled per tensor"),  # llm-compressor's static FP8
])
def test_a_compressed_tensors_scheme_this_cannot_read_is_refused_in_one_line_naming_it(
        synth_checkpoint, tmp_path: Path, change: dict, named: str) -> None:
    from qpack.spec import QpackError

    fp8 = derive(synth_checkpoint("glm4_moe", dtype="bfloat16"), tmp_path / "fp8", "fp8-channel")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (fp8 / "config.json").unlink()
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(QpackError) as err:
        open_source(fp8)
    message = str(err.value)
    assert "compressed-tensors checkpoint (format 'float-quantized', " + named in message
    assert "per channel or per block" in message and "\n" not in message
