"""MLX checkpoints beyond uniform affine: the mxfp4 / nvfp4 / mxfp8 modes gather_qmm runs,
and mlx_lm.convert's mixed-precision recipes (down_proj at 6 bits in some layers, 3 in the
others: per-projection formats inside a layer, per-layer formats in one pool). Each is
packed as it is and streamed to the same greedy tokens as mlx-lm running it resident."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_engine import engine_config
from helpers_forward import Reference, greedy_reference

from actors.pool.layout import PoolLayout
from actors.sampling_params import SamplingParams
from pipeline.engine import open_engine
from pipeline.events import Done
from qpack import spec
from qpack.spec import QpackError
from qpack.synth.wild import derive
from qpack.writer import pack

PROMPT = [4791, 11, 1879, 0, 151, 3000, 77, 1234]
KINDS = {"mxfp4": {"mode": "mxfp4"}, "nvfp4": {"mode": "nvfp4"}, "mxfp8": {"mode": "mxfp8"},
         # Every mlx_lm.convert --quant-predicate, as it writes them without --q-group-size
         # (`"group_size": null` per module).
         **{r: {"recipe": r} for r in ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")},
         # MLX's CPU gather_mm takes float32 only: the float experts are float32 there.
         "float_experts": {"recipe": "float_experts", "dtype": "float32"}}


@pytest.fixture(scope="module")
def packed(synth_checkpoint, tmp_path_factory):
    made: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            src = synth_checkpoint("qwen3_next", **{"dtype": "bfloat16", **KINDS[kind]})
            out = tmp_path_factory.mktemp(kind) / "c.qpack"
            pack(src, out, progress=False)
            made[kind] = (src, out)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", list(KINDS))
async def test_streams_to_mlx_lm_greedy_tokens(packed, kind: str) -> None:
    src, container = packed(kind)
    manifest = spec.decode_manifest((container / spec.MANIFEST).read_bytes(), container)
    ref = Reference(src)
    # Activations in the model's dtype (bf16), as mlx-lm runs it: then the tokens agree exactly.
    async with open_engine(engine_config(container, compute={"dtype": "model"})) as engine:
        want = greedy_reference(ref, PROMPT, 8, set(engine.tokenizer.eos_token_ids), chunk=2)
        events = [e async for e in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))]
        done = events[-1]
        assert isinstance(done, Done) and list(done.token_ids) == want
        layout = PoolLayout.of(manifest.layers)
        # The budget buys slots of every variant: the pool is exactly slots x that.
        assert engine.pool_bytes == engine.facts.slots * layout.slot_nbytes
    if kind.startswith("mixed_"):
        low, high = (int(b) for b in kind.split("_")[1:])
        recorded = json.loads((src / "config.json").read_text())["quantization"]
        assert any(isinstance(v, dict) and v["group_size"] is None for v in recorded.values())
        # tiny has 4 layers: mlx-lm's recipe gives layers 2 and 3 the high-bit down_proj.
        quant = {e.index: e.format.quant("down_proj")[0] for e in manifest.layers}
        assert quant == {0: low, 1: low, 2: high, 3: high}
        assert {e.index: e.format.quant("gate_proj")[0] for e in manifest.layers} == dict.fromkeys(range(4), low)
        assert {e.format.quant("gate_proj")[1] for e in manifest.layers} == {64}
        if kind == "mixed_3_6":
            # One more array: the 6-bit down_proj weight (its scales and biases keep their shape).
            assert layout.mixed and len(layout.arrays) == 9 + 1
    elif kind == "float_experts":
        fmt = manifest.layers[0].format
        assert fmt.bits is None and [t.name for t in fmt.tensors] == [
            "gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    else:
        mode = manifest.layers[0].format.mode
        assert mode == kind and not any(t.name.endswith("biases") for t in manifest.layers[0].format.tensors)
        assert not layout.mixed


def test_float_source_packs_like_the_mlx_convert_in_that_mode(synth_checkpoint, packed, tmp_path) -> None:
    """bf16 packed with mode mxfp4 == the MLX mxfp4 checkpoint packed as it is."""
    _src, from_mlx = packed("mxfp4")
    from_float = pack(synth_checkpoint("qwen3_next", dtype="bfloat16"), tmp_path / "f.qpack",
                      mode="mxfp4", progress=False).path
    files = {p.relative_to(from_mlx) for p in from_mlx.rglob("*") if p.is_file()} - {
        Path(spec.MANIFEST), Path(spec.CONFIG)}
    for rel in sorted(files):
        if rel.suffix in (".bin", ".safetensors"):
            assert (from_float / rel).read_bytes() == (from_mlx / rel).read_bytes(), rel
    assert json.loads((from_float / spec.CONFIG).read_text())["quantization"]["mode"] == "mxfp4"


def test_unsupported_quantizations_are_refused(synth_checkpoint, tmp_path) -> None:
    src = synth_checkpoint("qwen3_next", dtype="bfloat16")
    with pytest.raises(QpackError, match=r"mxfp4 quantization takes bits \[4\] and group size \[32\], "
                                         r"not 4 bits in groups of 64"):
        pack(src, tmp_path / "a.qpack", mode="mxfp4", group_size=64, progress=False)
    with pytest.raises(QpackError, match="quantization mode 'int4' is not one of affine, mxfp4, nvfp4, mxfp8"):
        pack(src, tmp_path / "b.qpack", mode="int4", progress=False)
    mlx = synth_checkpoint("qwen3_next", dtype="bfloat16", mode="nvfp4")
    wild = derive(mlx, tmp_path / "gs", "nvfp4-global-scale")
    with pytest.raises(QpackError, match="nvfp4 with a per-expert global_scale is not supported"):
        pack(wild, tmp_path / "c.qpack", progress=False)


def test_a_format_that_lies_about_its_quantization_is_refused_at_open(packed, tmp_path) -> None:
    from qpack.reader import Container

    _src, container = packed("mixed_3_6")
    copy = shutil.copytree(container, tmp_path / "lie.qpack")  # symlinks out are refused
    manifest = json.loads((container / spec.MANIFEST).read_text())
    layer = next(e for e in manifest["layers"] if e["format"]["projections"])
    layer["format"]["projections"][0]["bits"] = 5  # the 6-bit down_proj claimed as 5-bit
    (copy / spec.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(QpackError, match=r"down_proj: tensors do not fit 5-bit affine in groups of 64"):
        Container.open(copy)
