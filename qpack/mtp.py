"""The checkpoint's MTP head, kept as an optional part of the container: `mtp.safetensors`.

Qwen3-Next and Qwen3.5/3.6 checkpoints carry one multi-token-prediction module at their
root (`mtp.*`, see qpack/synth/mtp.py for the layout). mlx-lm drops it; the packer keeps
it beside the dense core, in mlx-lm's conventions for the module tree that
pipeline/models/mtp.py builds: `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
`norm`, and the decoder layer as `layer.*` with its routed experts stacked as
`layer.mlp.switch_mlp.{gate,up,down}_proj` (both hub layouts: per expert, or fused
gate_up), zero-centred norms +1. Float containers keep it float; quantized ones get it
at 8 bits (affine, group 64) whatever the rest has: published measurements show an
int4 MTP head collapsing to 0-4 % acceptance. The manifest's `mtp_layers` says it is
there; containers without it (older ones, MLX-quantized or FP8 sources, which carry no
head mlx-lm could read) are valid and simply cannot draft with MTP.

Its routed experts are written apart, in the container's expert format (one aligned
blob per expert, `spec.MTP_EXPERTS_FILE`, the manifest's `mtp_experts`, index
num_layers), so the engine streams them through a pool as it streams a layer's; the
dense part (fc, norms, attention, router, shared expert) stays in `mtp.safetensors`.
Containers packed before that keep the experts in `mtp.safetensors` as
`layer.mlp.switch_mlp.*` (no `mtp_experts`): the engine then holds them resident.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import mlx.core as mx

from qpack import spec
from qpack.quantize import Rule, quantize
from qpack.safetensors_io import mx_to_bytes

if TYPE_CHECKING:
    from qpack.layout import ContainerPlan
    from qpack.source import SourceCheckpoint

MTP_FILE = "mtp.safetensors"
MTP_BITS = 8
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
          "k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
_PER_EXPERT = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(gate_up_proj|down_proj)$")
SWITCH = "layer.mlp.switch_mlp."  # the routed experts' prefix in the module tree


def mtp_names(names: Iterable[str]) -> list[str]:
    """The source's MTP tensors (only the first MTP layer is used: Qwen ships one)."""
    return sorted(n for n in names if n.startswith("mtp.") and not n.startswith("mtp.layers.1"))


def packed_bytes(shape: tuple[int, ...], itemsize: int, bits: int | None) -> int:
    """About what one source tensor becomes in `mtp.safetensors` (free-space checks):
    float as it is, or a matrix at 8 bits with a scale and a bias per 64 values."""
    n = math.prod(shape)
    if bits is None or len(shape) < 2 or shape[-1] % 64:
        return n * itemsize
    return n * max(bits, MTP_BITS) // 8 + 2 * (n // 64) * itemsize


def mtp_bytes(src: SourceCheckpoint, plan: ContainerPlan) -> int:
    """About what the packer writes for the head (0 when the source's is not kept)."""
    if src.is_mlx or src.fp8 is not None:
        return 0
    bits = plan.quant.default.bits if plan.quant.default is not None else None
    total = 0
    for name in mtp_names(src.index):
        info = src.info(name)
        total += packed_bytes(tuple(info.shape), info.nbytes // max(1, math.prod(info.shape)), bits)
    # Each expert's blob is padded to the alignment at most once.
    return total + (src.num_experts * spec.ALIGNMENT if total else 0)


def _target(name: str) -> str:
    return name.removeprefix("mtp.").replace("layers.0.", "layer.", 1)


def mtp_arrays(read: dict[str, mx.array], num_experts: int, bits: int | None) -> dict[str, mx.array]:
    """The head's tensors under the module tree's names; `read`: source name -> array.

    `bits` None keeps it float; otherwise every matrix is quantized at max(bits, 8).
    """
    out: dict[str, mx.array] = {}
    experts: dict[str, list[mx.array | None]] = {}
    for name, arr in read.items():
        if m := _PER_EXPERT.match(name):
            experts.setdefault(m[2], [None] * num_experts)[int(m[1])] = arr
        elif m := _FUSED.match(name):
            if m[1] == "down_proj":
                out["layer.mlp.switch_mlp.down_proj.weight"] = arr
            else:
                half = arr.shape[1] // 2
                out["layer.mlp.switch_mlp.gate_proj.weight"] = arr[:, :half]
                out["layer.mlp.switch_mlp.up_proj.weight"] = arr[:, half:]
        else:
            target = _target(name)
            out[target] = arr + 1.0 if arr.ndim == 1 and target.endswith(_NORMS) or target == "norm.weight" else arr
    for proj, parts in experts.items():
        missing = [e for e, a in enumerate(parts) if a is None]
        if missing:
            raise ValueError(f"MTP layer {proj}: experts {missing[:8]} missing from the checkpoint")
        out[f"layer.mlp.switch_mlp.{proj}.weight"] = mx.stack(parts)  # type: ignore[arg-type]
    if bits is None:
        return out
    rule = Rule(max(bits, MTP_BITS), 64, "affine")
    quantized: dict[str, mx.array] = {}
    for name, arr in out.items():
        if arr.ndim >= 2 and name.endswith(".weight") and arr.shape[-1] % rule.group_size == 0:
            base = name.removesuffix(".weight")
            w, s, b = quantize(arr, rule)
            quantized.update({f"{base}.weight": w, f"{base}.scales": s, f"{base}.biases": b})
        else:
            quantized[name] = arr
    return quantized


def split_experts(arrays: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(dense part, routed experts as `{proj}.{part}` -> [E, ...]) of `mtp_arrays`' output."""
    dense = {n: a for n, a in arrays.items() if not n.startswith(SWITCH)}
    experts = {n.removeprefix(SWITCH): a for n, a in arrays.items() if n.startswith(SWITCH)}
    return dense, experts


def _dtype(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]  # mlx.core.bfloat16 -> bfloat16


def expert_layout(experts: dict[str, mx.array]) -> tuple[spec.ExpertFormat, int]:
    """The experts' format and stride: as a layer's, at 8 bits affine (group 64) when
    quantized (`mtp_arrays` quantizes every projection alike), else float."""
    shapes = {n: (tuple(a.shape[1:]), _dtype(a)) for n, a in experts.items()}
    quantized = any(n.endswith(".scales") for n in experts)
    fmt = spec.expert_format(shapes, *((MTP_BITS, 64, "affine") if quantized else (None, None, None)))
    return fmt, spec.round_up(fmt.nbytes, spec.ALIGNMENT)


def expert_blobs(experts: dict[str, mx.array], fmt: spec.ExpertFormat, stride: int) -> Iterator[bytearray]:
    """Each expert's blob (`stride` bytes, tensors at the format's offsets), in order."""
    count = next(iter(experts.values())).shape[0]
    for e in range(count):
        blob = bytearray(stride)
        for t in fmt.tensors:
            blob[t.offset : t.offset + t.nbytes] = mx_to_bytes(experts[t.name][e])
        yield blob


def blob_checksum(blob: bytearray, fmt: spec.ExpertFormat) -> int:
    return zlib.crc32(memoryview(blob)[: fmt.nbytes])
