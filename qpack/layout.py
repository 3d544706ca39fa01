"""What a container will hold, decided before any byte is written: the dense tensor
plan (names, dtypes, shapes in mlx-lm's terms) and each MoE layer's expert format.

Planning first lets dense.safetensors be streamed (its header goes first) and lets a
resumed pack check that it is continuing the same container.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from qpack.quantize import QuantPlan, Rule, plan, quantized_shapes, skeleton, target_dtype
from qpack.safetensors_io import PlannedTensor, spec_dtype, tag_of
from qpack.source import DenseRef, SourceCheckpoint
from qpack.spec import ALIGNMENT, PROJECTIONS, ExpertFormat, QpackError, expert_format, round_up


@dataclass
class DenseItem:
    ref: DenseRef
    rule: Rule | None  # quantize this weight
    cast: mx.Dtype | None  # cast float data to this dtype first
    outputs: list[PlannedTensor]


@dataclass
class LayerPlan:
    index: int
    format: ExpertFormat
    stride: int
    rule: Rule | None  # quantize float experts with this; None: copy or keep float
    cast: mx.Dtype | None


@dataclass
class ContainerPlan:
    config: dict  # config.json of the container
    quant: QuantPlan
    dense: list[DenseItem]
    layers: list[LayerPlan]
    copy_quantized: bool  # MLX quantized source: bytes are copied, never re-quantized

    def dense_plan(self) -> list[PlannedTensor]:
        return sorted((t for item in self.dense for t in item.outputs), key=lambda t: t.name)


def _switch_path(model_type: str, layer: int, proj: str) -> str:
    prefix = "language_model.model" if model_type == "qwen3_5_moe" else "model"
    return f"{prefix}.layers.{layer}.mlp.switch_mlp.{proj}"


def _source_rule(block: dict, path: str) -> Rule | None:
    over = block.get(path)
    if over is False:
        return None
    over = over if isinstance(over, dict) else {}
    bits = over.get("bits", block.get("bits"))
    gs = over.get("group_size", block.get("group_size"))
    return Rule(int(bits), int(gs), str(over.get("mode", block.get("mode", "affine"))))


def make_plan(src: SourceCheckpoint, bits: int | None, group_size: int, dtype: str | None) -> ContainerPlan:
    """bits: 4/8 quantize, None keep float (--bits 16); an MLX-quantized source keeps its own."""
    config = src.mlx_config()
    model = skeleton(config)
    copy_quantized = src.quantization is not None
    if copy_quantized:
        src_bits = src.quantization.get("bits")
        if bits is not None and bits != src_bits:
            raise QpackError(
                src.root / "config.json",
                f"source is already quantized at {src_bits} bits; moestream never re-quantizes "
                f"(pack it with --bits {src_bits}, or from the float checkpoint)",
            )
        if src.quantization.get("mode", "affine") != "affine":
            raise QpackError(src.root / "config.json", f"quantization mode {src.quantization.get('mode')!r} is not supported")
        quant = QuantPlan(_source_rule(src.quantization, "\0"))
        quant.overrides = {k: v for k, v in src.quantization.items() if isinstance(v, dict)}
        cast_to = None
    else:
        quant = plan(model, bits, group_size)
        cast_to = target_dtype(config, dtype) if (bits is not None or dtype is not None) else None
        block = quant.config_block()
        if block is not None:
            config["quantization"] = block
            config["quantization_config"] = block  # mlx-lm writes both (hf model tree #957)

    dense = [_dense_item(src, ref, quant, cast_to, copy_quantized) for ref in src.dense]
    layers = [_layer_plan(src, layer, quant, cast_to, copy_quantized) for layer in src.moe_layers]
    return ContainerPlan(config, quant, dense, layers, copy_quantized)


def _dense_item(src: SourceCheckpoint, ref: DenseRef, quant: QuantPlan, cast_to, copy_quantized: bool) -> DenseItem:  # noqa: ANN001
    info = src.info(ref.source)
    shape = info.shape
    if ref.moveaxis:
        shape = (shape[0], shape[2], shape[1])
    if copy_quantized:
        return DenseItem(ref, None, None, [PlannedTensor(ref.target, info.dtype, tuple(shape))])
    floating = info.dtype in ("BF16", "F16", "F32")
    cast = cast_to if floating and ref.target not in quant.cast_exempt else None
    tag = tag_of(cast) if cast is not None else info.dtype
    rule = quant.rule_for(ref.target) if floating else None
    if rule is None:
        return DenseItem(ref, None, cast, [PlannedTensor(ref.target, tag, tuple(shape))])
    module = ref.target[: -len(".weight")]
    shapes = quantized_shapes(tuple(shape), rule)
    outs = [
        PlannedTensor(f"{module}.weight", "U32", shapes["weight"]),
        PlannedTensor(f"{module}.scales", tag, shapes["scales"]),
        PlannedTensor(f"{module}.biases", tag, shapes["biases"]),
    ]
    return DenseItem(ref, rule, cast, outs)


def _layer_plan(src: SourceCheckpoint, layer: int, quant: QuantPlan, cast_to, copy_quantized: bool) -> LayerPlan:  # noqa: ANN001
    shapes = src.expert_shapes(layer)
    paths = [_switch_path(src.model_type, layer, p) for p in PROJECTIONS]
    if copy_quantized:
        rules = {_source_rule(src.quantization, p) for p in paths}
        if len(rules) != 1 or None in rules:
            raise QpackError(src.root / "config.json", f"layer {layer}: experts mix quantization settings {rules}")
        rule = rules.pop()
        for p in PROJECTIONS:
            for part in ("scales", "biases"):
                if f"{p}.{part}" not in shapes:
                    raise QpackError(src.root, f"layer {layer}: quantized source lacks switch_mlp.{p}.{part}")
        fmt = expert_format({k: (s, spec_dtype(t)) for k, (s, t) in shapes.items()}, rule.bits, rule.group_size, rule.mode)
        return LayerPlan(layer, fmt, round_up(fmt.nbytes, ALIGNMENT), None, None)
    missing = [p for p in paths if p not in quant.experts]
    if missing and quant.default is not None:
        raise QpackError(src.root, f"layer {layer} has routed experts but mlx-lm's model has no {missing[0]}")
    rules = {quant.experts[p] for p in paths} if quant.default is not None else {None}
    if len(rules) != 1:
        raise QpackError("--group-size", f"layer {layer}: expert projections would be quantized differently ({rules})")
    rule = rules.pop()
    if quant.default is not None and rule is None:
        raise QpackError("--group-size", f"layer {layer}: expert dimensions do not divide group size {quant.default.group_size}")
    fshapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for p in PROJECTIONS:
        shape, tag = shapes[f"{p}.weight"]
        name = spec_dtype(tag_of(cast_to)) if cast_to is not None else spec_dtype(tag)
        if rule is None:
            fshapes[f"{p}.weight"] = (shape, name)
            continue
        q = quantized_shapes(shape, rule)
        fshapes[f"{p}.weight"] = (q["weight"], "uint32")
        fshapes[f"{p}.scales"] = (q["scales"], name)
        fshapes[f"{p}.biases"] = (q["biases"], name)
    fmt = expert_format(fshapes, rule.bits if rule else None, rule.group_size if rule else None, rule.mode if rule else None)
    return LayerPlan(layer, fmt, round_up(fmt.nbytes, ALIGNMENT), rule, cast_to)
