"""Reading a source checkpoint (HF or MLX) one tensor at a time, in mlx-lm's terms.

Handles HF sharded safetensors (bf16/f16/f32, FP8 block-scaled) with per-expert
(`mlp.experts.{e}.{proj}.weight`) or fused (`mlp.experts.gate_up_proj` / `down_proj`)
experts, and MLX checkpoints (stacked `switch_mlp` experts, possibly quantized). What
differs per architecture (where the text config sits, tensor renames, norm and conv
fix-ups) is its family module's (qpack.families). Dense names are mapped exactly as the
mlx-lm model's `sanitize` would, tensor by tensor, so the whole checkpoint is never in
memory at once.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import msgspec

from qpack.checkpoint_kind import check_config, check_files, fp8_layout
from qpack.families import CheckpointFamily, UnsupportedModel, family
from qpack.fp8 import FP8_TAG, Fp8Layout, dequantize_rows, scale_rows
from qpack.names import target_name
from qpack.safetensors_io import SafetensorsFile, TensorInfo, bytes_to_mx, mx_to_bytes, open_index
from qpack.spec import PROJECTIONS, QpackError, parse_json

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)
_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


class RawTensor(msgspec.Struct):
    """A tensor's bytes as stored in the source, plus what they are."""

    tag: str  # safetensors dtype tag
    shape: tuple[int, ...]
    data: bytearray

    def to_mx(self) -> mx.array:
        return bytes_to_mx(self.data, self.tag, self.shape)


@dataclass(frozen=True)
class ExpertRef:
    """Where one projection part of a layer's experts lives in the source."""

    name: str  # source tensor name
    kind: str  # "per-expert" (name has {e}), "stacked" (row e), "fused-gate"/"fused-up" (row e, half)
    # A stacked row's fix-ups, in this order (a family's `expert_ref`: gpt-oss): swap its last
    # two axes ([in, out] -> [out, in]), keep its even or odd rows (interleaved gate/up),
    # read uint8 blocks [rows, groups, 16] as MLX's packed uint32 [rows, groups * 4].
    transpose: bool = False
    take: str = ""  # "even" | "odd" | ""
    u32: bool = False

    def fixed(self, t: RawTensor) -> RawTensor:
        """Row e of the source tensor as the expert's part (a copy where anything changes)."""
        if not (self.transpose or self.take or self.u32):
            return t
        import numpy as np

        arr = np.frombuffer(t.data, dtype=np.dtype(f"u{max(1, len(t.data) // max(1, _numel(t.shape)))}"))
        arr = arr.reshape(t.shape)
        if self.transpose:
            arr = arr.swapaxes(-1, -2)
        if self.take:
            arr = arr[0 if self.take == "even" else 1 :: 2]
        tag = t.tag
        if self.u32:
            arr, tag = np.ascontiguousarray(arr).reshape(arr.shape[0], -1).view(np.uint32), "U32"
        return RawTensor(tag, tuple(arr.shape), bytearray(np.ascontiguousarray(arr).tobytes()))

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part's shape from the source row's."""
        if self.transpose:
            shape = (*shape[:-2], shape[-1], shape[-2])
        if self.take:
            shape = ((shape[0] + (self.take == "even")) // 2, *shape[1:])
        if self.u32:
            shape = (shape[0], _numel(shape[1:]) // 4)
        return shape


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class DenseRef:
    target: str  # mlx-lm parameter name
    source: str
    moveaxis: bool = False  # conv1d weight [C,1,K] -> [C,K,1]
    plus_one: bool = False  # HF stores (1 + w) norms as w
    part: bool = False  # one of the parts the family cuts the source into (read whole, then cut)


@dataclass
class SourceCheckpoint:
    root: Path
    config: dict  # source config.json
    model_type: str  # container model type: the family's name
    text: dict  # the text model's arguments (text_config, or the flat config)
    quantization: dict | None  # MLX quantization block when the source is MLX quantized
    is_mlx: bool
    index: dict[str, Path]
    moe_layers: dict[int, dict[str, ExpertRef]] = field(default_factory=dict)
    dense: list[DenseRef] = field(default_factory=list)
    fp8: Fp8Layout | None = None  # an FP8 source (scaled e4m3 weights): read as bf16 (qpack.fp8)
    _files: dict[Path, SafetensorsFile] = field(default_factory=dict)

    # -- facts -------------------------------------------------------------
    @property
    def family(self) -> CheckpointFamily:
        return family(self.model_type)

    @property
    def num_experts(self) -> int:
        return int(self.text[self.family.experts_key])

    @property
    def top_k(self) -> int:
        return int(self.text["num_experts_per_tok"])

    @property
    def num_layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    def mlx_config(self) -> dict:
        """The config the mlx-lm model class understands (and the container ships)."""
        cfg = copy.deepcopy(self.config)
        cfg["model_type"] = self.model_type  # an alias (qwen3_5_moe_text) reads as its family
        self.family.fix_config(cfg)
        if self.fp8 is not None:  # the container holds what the dequantized weights become
            for where in (cfg, cfg.get("text_config") or {}):
                where.pop("quantization_config", None)
        return cfg

    def tokenizer_files(self) -> list[Path]:
        return [self.root / n for n in TOKENIZER_FILES if (self.root / n).is_file()]

    # -- tensor access -----------------------------------------------------
    def file(self, name: str) -> SafetensorsFile:
        path = self.index.get(name)
        if path is None:
            raise QpackError(self.root, f"tensor {name!r} is not in the checkpoint")
        f = self._files.get(path)
        if f is None:
            if not path.is_file():
                raise QpackError(path, f"shard listed in the index for {name!r} is missing")
            f = self._files[path] = SafetensorsFile(path)
        if name not in f.tensors:
            raise QpackError(path, f"tensor {name!r} listed in the index is not in this shard")
        return f

    def _fp8_scale(self, name: str) -> str | None:
        """The scale tensor of an FP8 weight (None: not an FP8 weight)."""
        if self.fp8 is None or self.file(name).tensors[name].dtype != FP8_TAG:
            return None
        scale = name + self.fp8.suffix
        if scale not in self.index:
            raise QpackError(self.root, f"FP8 tensor {name!r} has no {scale!r}")
        return scale

    def info(self, name: str) -> TensorInfo:
        info = self.file(name).tensors[name]
        if self._fp8_scale(name) is not None:  # what it reads as: bf16
            return TensorInfo("BF16", info.shape, info.start, info.nbytes * 2)
        return info

    def raw(self, name: str, row: int | None = None) -> RawTensor:
        f = self.file(name)
        info = f.tensors[name]
        shape = info.shape if row is None else info.shape[1:]
        scale = self._fp8_scale(name)
        if scale is not None:
            data = bytes_to_mx(f.read_bytes(name, row), "U8", shape)
            s = self.file(scale).tensors[scale]
            s_arr = bytes_to_mx(self.file(scale).read_bytes(scale, row), s.dtype,
                                s.shape if row is None else s.shape[1:])
            assert self.fp8 is not None  # a scale is found only in an FP8 source
            arr = dequantize_rows(data, s_arr, self.fp8.block, 0, mx.bfloat16)
            return RawTensor("BF16", shape, bytearray(mx_to_bytes(arr)))
        return RawTensor(info.dtype, shape, f.read_bytes(name, row))

    def dense_tensor(self, ref: DenseRef, rows: tuple[int, int] | None = None) -> mx.array:
        """One dense tensor (or rows start..stop of it) under its mlx-lm name, sanitized as
        mlx-lm would. Every fix-up keeps the leading axis, so rows can be done apart."""
        scale = self._fp8_scale(ref.source)
        if ref.part:  # cut from the whole tensor (small: one attention projection)
            arr = self.family.dense_part(ref.target, ref.source, lambda n: self.raw(n).to_mx(), self.text,
                                         self.quantization is not None)
            return arr if rows is None else arr[rows[0] : rows[1]]
        if rows is None:
            arr = self.raw(ref.source).to_mx()
        elif scale is not None:
            f = self.file(ref.source)
            info = f.tensors[ref.source]
            data = bytes_to_mx(f.read_rows(ref.source, *rows), "U8", (rows[1] - rows[0], *info.shape[1:]))
            assert self.fp8 is not None  # as in `raw`
            b0, _ = self.fp8.block
            lo, hi = scale_rows(rows[0], rows[1] - rows[0], b0)
            s = self.file(scale).tensors[scale]
            s_arr = bytes_to_mx(self.file(scale).read_rows(scale, lo, hi), s.dtype, (hi - lo, *s.shape[1:]))
            arr = dequantize_rows(data, s_arr, self.fp8.block, rows[0], mx.bfloat16)
        else:
            f = self.file(ref.source)
            info = f.tensors[ref.source]
            shape = (rows[1] - rows[0], *info.shape[1:]) if info.shape else ()
            arr = bytes_to_mx(f.read_rows(ref.source, *rows), info.dtype, shape)
        if ref.moveaxis:
            arr = arr.moveaxis(2, 1)
        if ref.plus_one:
            arr = arr + 1.0
        return arr

    def expert(self, layer: int, e: int) -> dict[str, RawTensor]:
        """Expert e of a layer: "{proj}.{part}" -> its bytes (source dtype, unquantized
        or MLX-quantized exactly as stored)."""
        out: dict[str, RawTensor] = {}
        for key, ref in self.moe_layers[layer].items():
            if ref.kind == "per-expert":
                out[key] = self.raw(ref.name.format(e=e))
            elif ref.kind == "stacked":
                out[key] = ref.fixed(self.raw(ref.name, row=e))
            else:
                t = self.raw(ref.name, row=e)
                half = len(t.data) // 2
                rows = t.shape[0] // 2
                data = t.data[:half] if ref.kind == "fused-gate" else t.data[half:]
                out[key] = RawTensor(t.tag, (rows, *t.shape[1:]), data)
        return out

    def expert_shapes(self, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and safetensors tag of each part of one expert, without reading data."""
        out = {}
        for key, ref in self.moe_layers[layer].items():
            name = ref.name.format(e=0) if ref.kind == "per-expert" else ref.name
            info = self.info(name)
            shape = info.shape if ref.kind == "per-expert" else info.shape[1:]
            if ref.kind.startswith("fused"):
                shape = (shape[0] // 2, *shape[1:])
            out[key] = (ref.shape(tuple(shape)), "U32" if ref.u32 else info.dtype)
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _load_config(root: Path) -> dict:
    path = root / "config.json"
    if root.is_dir():
        check_files([p.name for p in root.iterdir()], root)
    if not path.is_file():
        raise QpackError(root, "not a checkpoint directory (no config.json)")
    cfg = parse_json(path.read_bytes(), path, "config.json")
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise QpackError(path, "config.json has no model_type")
    return cfg


def _experts(names: list[str], num_experts: int, root: Path,
             fam: CheckpointFamily) -> dict[int, dict[str, ExpertRef]]:
    """`names`: the text model's tensors only (MTP heads and the like are dropped first)."""
    layers: dict[int, dict[str, ExpertRef]] = {}
    seen: dict[tuple[int, str], set[int]] = {}
    for name in names:
        if (own := fam.expert_ref(name)) is not None:  # the family's own layout (gpt-oss)
            for layer, key, transpose, take, u32 in own:
                layers.setdefault(layer, {})[key] = ExpertRef(name, "stacked", transpose, take, u32)
        elif m := _PER_EXPERT.search(name):
            layer, e, proj = int(m[1]), int(m[2]), m[3]
            seen.setdefault((layer, proj), set()).add(e)
            template = name[: m.start(2)] + "{e}" + name[m.end(2) :]
            layers.setdefault(layer, {})[f"{proj}.weight"] = ExpertRef(template, "per-expert")
        elif m := _FUSED.search(name):
            layer = int(m[1])
            refs = layers.setdefault(layer, {})
            if m[2] == "down_proj":
                refs["down_proj.weight"] = ExpertRef(name, "stacked")
            else:
                refs["gate_proj.weight"] = ExpertRef(name, "fused-gate")
                refs["up_proj.weight"] = ExpertRef(name, "fused-up")
        elif m := _STACKED.search(name):
            layers.setdefault(int(m[1]), {})[f"{m[2]}.{m[3]}"] = ExpertRef(name, "stacked")
    for (layer, proj), es in seen.items():
        if es != set(range(num_experts)):
            missing = sorted(set(range(num_experts)) - es)[:8]
            raise QpackError(root, f"layer {layer} {proj}: experts {missing} missing from the checkpoint")
    for layer, refs in layers.items():
        for proj in PROJECTIONS:
            if f"{proj}.weight" not in refs:
                raise QpackError(root, f"layer {layer}: no {proj} weight for the routed experts")
    return dict(sorted(layers.items()))


def open_source(root: str | Path) -> SourceCheckpoint:
    root = Path(root)
    config = _load_config(root)
    try:
        fam = family(config["model_type"])
    except UnsupportedModel as exc:
        raise QpackError(root / "config.json", str(exc)) from None
    model_type = fam.name
    text = fam.text_config(config)
    for key in (fam.experts_key, "num_experts_per_tok", "num_hidden_layers"):
        if key not in text:
            raise QpackError(root / "config.json", f"config has no {key!r}")
    check_config(config, root / "config.json")
    # An MLX block, or the family's reading of a native quantization (gpt-oss's mxfp4 experts).
    quantization = fam.source_quantization(config)
    native = quantization is not None and config.get("quantization") is None
    index = open_index(root)
    fp8 = fp8_layout(config)
    # FP8 scales are read with their weights, never as tensors of their own.
    names = sorted(n for n in index if not (fp8 and fp8.skips(n)))
    src = SourceCheckpoint(root, config, model_type, text, quantization, False, index, fp8=fp8)
    text_names = [n for n in names if target_name(model_type, n, text) is not None]
    src.moe_layers = _experts(text_names, src.num_experts, root, fam)
    if not src.moe_layers:
        raise QpackError(root, "no routed expert tensors found")
    kinds = {ref.kind for refs in src.moe_layers.values() for ref in refs.values()}
    src.is_mlx = kinds == {"stacked"} and any(f".{fam.routed_module}.gate_proj." in n for n in names)
    if quantization is not None and not src.is_mlx and not native:
        raise QpackError(root / "config.json", "config has a quantization block but tensors are not MLX-stacked")
    expert_names = {
        (ref.name.format(e=e) if ref.kind == "per-expert" else ref.name)
        for refs in src.moe_layers.values()
        for ref in refs.values()
        for e in (range(src.num_experts) if ref.kind == "per-expert" else (0,))
    }
    src.dense = _dense_refs(src, [n for n in names if n not in expert_names])
    return src


def _dense_refs(src: SourceCheckpoint, names: list[str]) -> list[DenseRef]:
    """mlx-lm `sanitize`, decided per tensor: which HF fix-ups apply is a property of
    the whole checkpoint (HF vs already-sanitized MLX), so decide it once here."""
    conv_unsanitized = any(
        "conv1d.weight" in n and src.info(n).shape[-1] != 1 for n in names if "mtp." not in n
    )
    tied = bool(src.text.get("tie_word_embeddings", src.config.get("tie_word_embeddings", False)))
    refs = []
    for name in names:
        target = target_name(src.model_type, name, src.text)
        if target is None or (tied and target.endswith("lm_head.weight")):
            continue
        info = src.info(name)
        moveaxis, plus_one = src.family.dense_fixups(target, tuple(info.shape), src.is_mlx, conv_unsanitized)
        parts = src.family.dense_parts(target, src.quantization is not None)
        refs += [DenseRef(p, name, moveaxis, plus_one, part=parts != (target,)) for p in parts]
    refs.sort(key=lambda r: r.target)
    counts = Counter(r.target for r in refs)
    dupes = [t for t, n in counts.items() if n > 1]
    if dupes:
        raise QpackError(src.root, f"tensors map to the same mlx-lm name: {sorted(dupes)[:5]}")
    return refs
