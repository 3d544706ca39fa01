"""Pack-time quantization rules, decided exactly as `mlx_lm.convert` would.

The decision of which modules get quantized (and at what bits) comes from the mlx-lm
model itself: we build its module tree lazily (no weights are materialized) and ask
each module the same questions `mlx_lm.utils.quantize_model` asks: does it have
`to_quantized`, does its last dimension divide the group size, and what does the
model's `quant_predicate` say. The routed experts (SwitchLinear) follow the same rule;
they are quantized one expert at a time, which equals quantizing the stacked tensor
because affine quantization groups never cross rows.
"""

from __future__ import annotations

import copy
import typing
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from qpack.mlx_model import model_classes
from qpack.spec import QpackError

# MLX's quantization modes that mx.gather_qmm runs, each with the (bits, group sizes) it
# takes (checked on MLX 0.32.4's CPU backend, every case, by benchmarks/quant_modes_check.py,
# which is the check to run on a GPU). The fp modes keep one uint8 scale per group and no
# biases.
MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128)),
    "mxfp4": ((4,), (32,)),
    "nvfp4": ((4,), (16,)),
    "mxfp8": ((8,), (32,)),
}
MODE_DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def check_rule(rule: Rule, where: str) -> Rule:
    """Refuse a (mode, bits, group size) that gather_qmm cannot run, naming what it can."""
    if rule.mode not in MODES:
        raise QpackError(where, f"quantization mode {rule.mode!r} is not supported: MLX's "
                         f"gather_qmm runs {', '.join(MODES)}")
    bits, sizes = MODES[rule.mode]
    if rule.bits not in bits or rule.group_size not in sizes:
        raise QpackError(where, f"{rule.mode} quantization takes bits {list(bits)} and group size "
                         f"{list(sizes)}, not {rule.bits} bits in groups of {rule.group_size}")
    return rule


@dataclass(frozen=True)
class Rule:
    bits: int
    group_size: int
    mode: str = "affine"


@dataclass
class QuantPlan:
    default: Rule | None  # None: unquantized container
    dense: dict[str, Rule] = field(default_factory=dict)  # module path -> rule
    overrides: dict[str, dict[str, int | str]] = field(default_factory=dict)  # as mlx-lm writes
    experts: dict[str, Rule | None] = field(default_factory=dict)  # switch_mlp module path -> rule
    cast_exempt: set[str] = field(default_factory=set)  # parameter names never cast

    def rule_for(self, param: str) -> Rule | None:
        """The rule for a dense parameter name (only `<module>.weight` is quantized)."""
        if not param.endswith(".weight"):
            return None
        return self.dense.get(param[: -len(".weight")])

    def config_block(self) -> dict | None:
        """The mlx-lm `quantization` block for config.json."""
        if self.default is None:
            return None
        block: dict = {
            "group_size": self.default.group_size,
            "bits": self.default.bits,
            "mode": self.default.mode,
        }
        block.update(copy.deepcopy(self.overrides))
        return block


def flat_parameters(model: nn.Module) -> list[tuple[str, Any]]:
    """`tree_flatten(model.parameters())`: (dotted name, array) pairs. (MLX annotates
    tree_flatten for a dict destination too, which it returns when given one.)"""
    from mlx.utils import tree_flatten

    return typing.cast(list[tuple[str, Any]], tree_flatten(model.parameters()))


def skeleton(config: dict) -> nn.Module:
    """The mlx-lm model for a config; parameters stay lazy, so this is cheap at any size."""
    try:
        model_class, args_class = model_classes(config)
        return model_class(args_class.from_dict(config))
    except (ValueError, TypeError, KeyError) as exc:
        raise QpackError("config.json", f"mlx-lm cannot build model_type {config.get('model_type')!r}: {exc}") from None


def plan(model: nn.Module, bits: int | None, group_size: int, mode: str = "affine") -> QuantPlan:
    """Mirror of mlx_lm.utils.quantize_model's wrapped predicate, without touching weights."""
    cast_pred = getattr(model, "cast_predicate", None)
    exempt = set()
    if cast_pred is not None:
        exempt = {k for k, _ in flat_parameters(model) if not cast_pred(k)}
    if bits is None:
        return QuantPlan(None, cast_exempt=exempt)
    default = check_rule(Rule(bits, group_size, mode), "--mode")
    predicate = getattr(model, "quant_predicate", None)
    out = QuantPlan(default, cast_exempt=exempt)
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized"):
            continue
        rule: Rule | None = None
        if module.weight.shape[-1] % group_size == 0:
            decision = predicate(path, module) if predicate is not None else True
            if isinstance(decision, dict):
                rule = Rule(int(decision["bits"]), int(decision["group_size"]), str(decision.get("mode", "affine")))
                out.overrides[path] = dict(decision)
            elif decision:
                rule = default
        if isinstance(module, SwitchLinear):
            out.experts[path] = rule
        elif rule is not None:
            out.dense[path] = rule
    return out


def quantized_shapes(shape: tuple[int, ...], rule: Rule) -> dict[str, tuple[int, ...]]:
    """Shapes of weight/scales(/biases) that mx.quantize returns for a [..., in] weight."""
    *lead, last = shape
    if last % rule.group_size or (last * rule.bits) % 32:
        raise QpackError("--group-size", f"last dimension {last} does not split into groups of {rule.group_size}")
    shapes = {
        "weight": (*lead, last * rule.bits // 32),
        "scales": (*lead, last // rule.group_size),
    }
    if rule.mode == "affine":
        shapes["biases"] = (*lead, last // rule.group_size)
    return shapes


def scale_dtype(rule: Rule, float_dtype: str) -> str:
    """Spec dtype of the scales (and biases): the weights' float dtype for affine, uint8
    (e8m0 / e4m3 exponents) for the fp modes."""
    return float_dtype if rule.mode == "affine" else "uint8"


def quantize(w: mx.array, rule: Rule) -> tuple[mx.array, ...]:
    """weight, scales (and biases for affine), as mx.quantize returns them."""
    out = tuple(mx.quantize(w, group_size=rule.group_size, bits=rule.bits, mode=rule.mode))
    mx.eval(*out)
    return out


def target_dtype(config: dict, requested: str | None) -> mx.Dtype | None:
    """The dtype mlx_lm.convert casts float weights to: --dtype, else the config's."""
    name = requested
    if name is None:
        text = config.get("text_config") or {}
        name = config.get("torch_dtype") or config.get("dtype") or text.get("dtype") or text.get("torch_dtype")
    if name is None:
        return None
    if name not in ("float16", "bfloat16", "float32"):
        raise QpackError("--dtype", f"dtype {name!r} is not one of float16, bfloat16, float32")
    return getattr(mx, name)


def cast(arr: mx.array, dtype: mx.Dtype | None) -> mx.array:
    if dtype is None or not mx.issubdtype(arr.dtype, mx.floating) or arr.dtype == dtype:
        return arr
    return arr.astype(dtype)
