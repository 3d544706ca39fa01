"""gpt-oss's routed experts in its three source layouts (qpack/families/gpt_oss.py), with the
same values in each for one seed: every expert's gate / up / down weights are the generic
`expert_init`s, and each projection has a bias (`expert_bias`).

- hub (transformers' float layout): `gate_up_proj` [E, H, 2I] (gate and up interleaved in
  the last axis), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H].
- mxfp4 (the official release): `gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] and
  `gate_up_proj_scales` uint8 [E, 2I, H/32] (MLX's mxfp4 of the interleaved [2I, H] weight:
  the bytes mlx-lm's sanitize reads), `down_proj_blocks` / `_scales`, biases in bf16.
- MLX (bits given): mlx-lm's sanitized names, `mlp.experts.{proj}.weight|scales|biases`
  and `mlp.experts.{proj}.bias`, quantized as mlx_lm.convert would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init, to_storage
from qpack.synth.mlx_quant import mlx_quantize
from qpack.synth.st_write import ST_DTYPES, TensorEntry
from qpack.synth.tensor_inits import expert_init

_PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_bias(dims: ModelDims, layer: int, expert: int, proj: str) -> Init:
    n = dims.hidden_size if proj == "down_proj" else dims.moe_intermediate_size
    return Init(f"layers.{layer}.mlp.experts.{expert}.{proj}.bias", (n,), "normal", 0.02)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows (or elements) 2j = gate[j], 2j+1 = up[j]."""
    out = np.empty((2 * gate.shape[0], *gate.shape[1:]), dtype=gate.dtype)
    out[0::2], out[1::2] = gate, up
    return out


def expert_entries(writer: Any, layer: int) -> list[TensorEntry]:
    d, src = writer.dims, writer.src
    e_n, i, h = d.num_experts, d.moe_intermediate_size, d.hidden_size
    pre = writer.prefix + f"layers.{layer}.mlp.experts."

    def weight(e: int, proj: str) -> np.ndarray:  # [out, in] float32
        return src.full(expert_init(d, layer, e, proj))

    def bias(e: int, proj: str) -> np.ndarray:
        return src.full(expert_bias(d, layer, e, proj))

    def per_expert(make: Any, store: str | None) -> Any:
        def chunks() -> Iterator[np.ndarray]:
            for e in range(e_n):
                arr = make(e)[None]
                yield arr if store is None else to_storage(arr, store)

        return chunks

    if writer.mlx:
        out: list[TensorEntry] = []
        for proj in _PROJS:
            shape = (e_n, h, i) if proj == "down_proj" else (e_n, i, h)
            out += writer._quantized(pre + f"{proj}.weight", shape,
                                     per_expert(lambda e, p=proj: weight(e, p), None))
            n = h if proj == "down_proj" else i
            out.append(writer._plain(pre + f"{proj}.bias", (e_n, n),
                                     per_expert(lambda e, p=proj: bias(e, p), None), writer.dtype))
        return out
    gate_up = lambda e: _interleave(weight(e, "gate_proj"), weight(e, "up_proj"))  # noqa: E731
    gate_up_bias = lambda e: _interleave(bias(e, "gate_proj"), bias(e, "up_proj"))  # noqa: E731
    if writer.layout == "mxfp4":
        bf16 = ST_DTYPES["bfloat16"]
        return [
            *_mxfp4(pre + "gate_up_proj", e_n, gate_up, 2 * i, h),
            TensorEntry(pre + "gate_up_proj_bias", bf16, (e_n, 2 * i), per_expert(gate_up_bias, "bfloat16")),
            *_mxfp4(pre + "down_proj", e_n, lambda e: weight(e, "down_proj"), h, i),
            TensorEntry(pre + "down_proj_bias", bf16, (e_n, h),
                        per_expert(lambda e: bias(e, "down_proj"), "bfloat16")),
        ]
    st = ST_DTYPES[writer.dtype]
    return [
        TensorEntry(pre + "gate_up_proj", st, (e_n, h, 2 * i), per_expert(lambda e: gate_up(e).T, writer.dtype)),
        TensorEntry(pre + "gate_up_proj_bias", st, (e_n, 2 * i), per_expert(gate_up_bias, writer.dtype)),
        TensorEntry(pre + "down_proj", st, (e_n, i, h), per_expert(lambda e: weight(e, "down_proj").T, writer.dtype)),
        TensorEntry(pre + "down_proj_bias", st, (e_n, h), per_expert(lambda e: bias(e, "down_proj"), writer.dtype)),
    ]


def _mxfp4(name: str, e_n: int, make: Any, rows: int, cols: int) -> list[TensorEntry]:
    """`name`_blocks / `name`_scales: MLX's mxfp4 of each expert's [rows, cols] weight (its
    bf16 values, as the release was quantized from bf16), the weight's uint32 words as bytes."""
    groups = cols // 32

    def part(which: int) -> Any:
        def chunks() -> Iterator[np.ndarray]:
            for e in range(e_n):
                q = mlx_quantize(make(e), "bfloat16", 4, 32, "mxfp4")[which]
                yield np.ascontiguousarray(q).view(np.uint8).reshape(1, rows, groups, *((16,) if which == 0 else ()))

        return chunks

    return [TensorEntry(name + "_blocks", "U8", (e_n, rows, groups, 16), part(0)),
            TensorEntry(name + "_scales", "U8", (e_n, rows, groups), part(1))]
