"""What a container will hold, decided before any byte is written: the dense tensor
plan (names, dtypes, shapes in mlx-lm's terms) and each MoE layer's expert format.

Planning first lets dense.safetensors be streamed (its header goes first) and lets a
resumed pack check that it is continuing the same container.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from qpack.families import family
from qpack.quantize import (
    MODE_DEFAULTS,
    QuantPlan,
    Rule,
    check_rule,
    plan,
    quantized_shapes,
    scale_dtype,
    skeleton,
    target_dtype,
)
from qpack.safetensors_io import PlannedTensor, spec_dtype, tag_of
from qpack.source import DenseRef, SourceCheckpoint
from qpack.spec import (
    ALIGNMENT,
    PROJECTIONS,
    ExpertFormat,
    ProjectionQuant,
    QpackError,
    expert_format,
    round_up,
)


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
    rule: Rule | None  # the first projection's rule (see `rules`)
    cast: mx.Dtype | None
    rules: dict[str, Rule | None] = field(default_factory=dict)  # per projection; None: float


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
    fam = family(model_type)
    return f"{fam.decoder_prefix}.layers.{layer}.mlp.{fam.routed_module}.{proj}"


def _source_rule(block: dict, path: str) -> Rule | None:
    over = block.get(path)
    if over is False:
        return None
    if isinstance(over, dict):
        # mlx-lm's loader passes a per-module dict to `to_quantized` as is: a key it lacks
        # takes to_quantized's default (affine), not the block's.
        return _rule(over, str(over.get("mode") or "affine"))
    return _rule(block, str(block.get("mode") or "affine"))


def _rule(entry: dict, mode: str) -> Rule:
    """A quantization entry's rule; a missing or null bits / group size is the mode's
    default, as MLX's `to_quantized` takes it (`mlx_lm convert --quant-predicate` without
    --q-group-size records `"group_size": null`). An unknown mode gets 0s, for
    check_rule to refuse by name."""
    bits, group_size = MODE_DEFAULTS.get(mode, (0, 0))
    given_bits, given_size = entry.get("bits"), entry.get("group_size")
    return Rule(int(bits if given_bits is None else given_bits),
                int(group_size if given_size is None else given_size), mode)


def _filled(override: dict) -> dict:
    rule = _rule(override, str(override.get("mode") or "affine"))
    return {**override, "bits": rule.bits, "group_size": rule.group_size}


def make_plan(src: SourceCheckpoint, bits: int | None, group_size: int, dtype: str | None,
              mode: str = "affine") -> ContainerPlan:
    """bits: quantize in `mode`, None keep float (--bits 16); an MLX-quantized source keeps its own."""
    config = src.mlx_config()
    model = skeleton(config)
    copy_quantized = src.quantization is not None
    if src.quantization is not None:  # copy_quantized
        src_bits = src.quantization.get("bits")
        if bits is not None and bits != src_bits:
            raise QpackError(
                src.root / "config.json",
                f"source is already quantized at {src_bits} bits; moestream never re-quantizes "
                f"(pack it with --bits {src_bits}, or from the float checkpoint)",
            )
        if any(isinstance(v, dict) and v.get("global_scale") for v in src.quantization.values()):
            raise QpackError(src.root / "config.json", "nvfp4 with a per-expert global_scale is not "
                             "supported (gather_qmm over pool slots has no per-slot global scale)")
        block_rule = _source_rule(src.quantization, "\0")  # "\0" names no module: the block's
        assert block_rule is not None
        quant = QuantPlan(check_rule(block_rule, str(src.root / "config.json")))
        # Nulls filled in (the manifest types them; to_quantized reads them the same way).
        quant.overrides = {k: _filled(v) for k, v in src.quantization.items() if isinstance(v, dict)}
        cast_to = None
    else:
        quant = plan(model, bits, group_size, mode)
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
    shape, tag = info.shape, info.dtype
    if ref.moveaxis:
        shape = (shape[0], shape[2], shape[1])
    if ref.part:
        tag, shape = src.family.dense_part_plan(ref.target, ref.source, src.info, src.text, copy_quantized)
    if copy_quantized:
        return DenseItem(ref, None, None, [PlannedTensor(ref.target, tag, tuple(shape))])
    floating = info.dtype in ("BF16", "F16", "F32")
    cast = cast_to if floating and ref.target not in quant.cast_exempt else None
    tag = tag_of(cast) if cast is not None else info.dtype
    rule = quant.rule_for(ref.target) if floating else None
    if rule is None:
        return DenseItem(ref, None, cast, [PlannedTensor(ref.target, tag, tuple(shape))])
    module = ref.target[: -len(".weight")]
    shapes = quantized_shapes(tuple(shape), rule)
    scale_tag = tag if rule.mode == "affine" else "U8"
    outs = [PlannedTensor(f"{module}.{part}", "U32" if part == "weight" else scale_tag, qshape)
            for part, qshape in shapes.items()]
    return DenseItem(ref, rule, cast, outs)


def _layer_plan(src: SourceCheckpoint, layer: int, quant: QuantPlan, cast_to, copy_quantized: bool) -> LayerPlan:  # noqa: ANN001
    """One MoE layer's expert format. Each projection has its own rule (mixed-precision
    recipes give down_proj more bits, some leave experts unquantized); the layer's
    format records the first projection's rule and the ones that differ from it."""
    shapes = src.expert_shapes(layer)
    paths = {p: _switch_path(src.model_type, layer, p) for p in PROJECTIONS}
    if copy_quantized:
        assert src.quantization is not None
        rules = {p: _source_rule(src.quantization, path) for p, path in paths.items()}
        for p, rule in rules.items():
            if rule is not None:
                check_rule(rule, str(src.root / "config.json"))
            wanted = () if rule is None else ("scales", "biases") if rule.mode == "affine" else ("scales",)
            for part in wanted:
                if f"{p}.{part}" not in shapes:
                    raise QpackError(src.root, f"layer {layer}: quantized source lacks switch_mlp.{p}.{part}")
            have = {k.split(".")[1] for k in shapes if k.startswith(p + ".")} - {"bias"}
            if rule is None and have != {"weight"}:
                raise QpackError(src.root, f"layer {layer}: switch_mlp.{p} has {sorted(have)} but the "
                                 "config does not quantize it")
        fmt = _format({k: (s, spec_dtype(t)) for k, (s, t) in shapes.items()}, rules)
        return LayerPlan(layer, fmt, round_up(fmt.nbytes, ALIGNMENT), None, None, rules)
    missing = [path for path in paths.values() if path not in quant.experts]
    if missing and quant.default is not None:
        raise QpackError(src.root, f"layer {layer} has routed experts but mlx-lm's model has no {missing[0]}")
    rules = {p: quant.experts[path] if quant.default is not None else None for p, path in paths.items()}
    if quant.default is not None and None in rules.values():
        raise QpackError("--group-size", f"layer {layer}: expert dimensions do not divide group size {quant.default.group_size}")
    fshapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for p in PROJECTIONS:
        shape, tag = shapes[f"{p}.weight"]
        name = spec_dtype(tag_of(cast_to)) if cast_to is not None else spec_dtype(tag)
        rule = rules[p]
        if rule is None:
            fshapes[f"{p}.weight"] = (shape, name)
            continue
        for part, qshape in quantized_shapes(shape, rule).items():
            fshapes[f"{p}.{part}"] = (qshape, "uint32" if part == "weight" else scale_dtype(rule, name))
    for p in PROJECTIONS:  # a per-expert additive bias (gpt-oss) stays float, cast as the weights
        if f"{p}.bias" in shapes:
            shape, tag = shapes[f"{p}.bias"]
            fshapes[f"{p}.bias"] = (shape, spec_dtype(tag_of(cast_to)) if cast_to is not None else spec_dtype(tag))
    fmt = _format(fshapes, rules)
    first = rules[PROJECTIONS[0]]
    return LayerPlan(layer, fmt, round_up(fmt.nbytes, ALIGNMENT), first, cast_to, rules)


def _format(shapes: dict[str, tuple[tuple[int, ...], str]], rules: dict[str, Rule | None]) -> ExpertFormat:
    first = rules[PROJECTIONS[0]]
    differ = tuple(
        ProjectionQuant(p, r.bits if r else None, r.group_size if r else None, r.mode if r else None)
        for p, r in rules.items() if r != first
    )
    return expert_format(shapes, first.bits if first else None, first.group_size if first else None,
                         first.mode if first else None, differ)
